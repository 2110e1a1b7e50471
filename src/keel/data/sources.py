"""Input sources of `keel data prepare`: which files make up each named source, and their documents.

`resolve_inputs` turns the configured paths of every source (files, directories, globs, 'stdlib', fsspec
URLs such as s3://bucket/prefix/*.parquet, or Hugging Face datasets hf:NAME[:CONFIG][@SPLIT], the last two
fetched into a local cache by keel.data.remote) into one deterministic list of `InputFile`s, failing
early with a one-line `DataError` on anything that would otherwise surface hours later: a missing path, a
type we cannot read, an unreadable or empty file, a source that holds nothing, or a file claimed by two
sources (it would be counted twice and tilt the mixture).

`read_documents` streams one file's documents as `str`. A text file is one document; every line of
a JSON Lines file (plain, gzip or zstd) and every row of a Parquet file is one. Damage inside a file does
not stop a long preparation: a bad line or a null row is appended to the caller's `malformed` list
as `path:line N: reason` and reading goes on; a truncated or corrupt compressed stream ends that
file with a `path: reason` entry. `damage` says beforehand whether a file can be read at all, and where it
breaks (a zstd file's compressed byte and frame), for the caller to skip a file whose text cannot be trusted.
Memory stays bounded by the largest single document: lines are read one at a time and Parquet in small
record batches.

Every document comes out as valid Unicode that encodes to UTF-8: undecodable bytes of text files
become U+FFFD, and so do the lone surrogates that JSON `\\ud800` escapes can produce; each document so
repaired is appended to the caller's `repaired` list.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import re
import sysconfig
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from keel.data.remote import fetch, is_remote
from keel.errors import DataError
from keel.paths import check_input, check_name, shown

BUILTIN_STDLIB = "stdlib"
CODE_SUFFIXES = (".py",)
TEXT_SUFFIXES = (".txt", ".md") + CODE_SUFFIXES
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst")
PARQUET_SUFFIXES = (".parquet",)
SUFFIXES = TEXT_SUFFIXES + JSONL_SUFFIXES + PARQUET_SUFFIXES
PARQUET_BATCH_ROWS = 1024  # rows per record batch: bounds memory on files of long documents

_GLOB_CHARS = re.compile(r"[*?\[]")
_SURROGATE = re.compile("[\ud800-\udfff]")


@dataclass(frozen=True)
class InputFile:
    """One file of a named source; `kind` is how its documents are read: text, jsonl or parquet."""

    source: str
    path: Path
    kind: str

    @property
    def is_code(self) -> bool:
        return self.path.suffix in CODE_SUFFIXES

    @property
    def size(self) -> int:
        """Bytes on disk (compressed size for .jsonl.gz, .jsonl.zst and .parquet)."""
        return self.path.stat().st_size


def stdlib_files() -> list[Path]:
    """The running interpreter's standard library sources, without site-packages."""
    found = []
    for directory, dirs, files in os.walk(sysconfig.get_paths()["stdlib"]):  # 30x faster than Path.rglob
        dirs[:] = [d for d in dirs if d not in ("site-packages", "dist-packages", "__pycache__")]
        found += [os.path.join(directory, f) for f in files if f.endswith(".py")]
    return sorted(map(Path, found))


def file_kind(path: Path) -> str | None:
    """text, jsonl or parquet by the file name's ending; None for a type we do not read."""
    name = path.name
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(PARQUET_SUFFIXES):
        return "parquet"
    if path.suffix in TEXT_SUFFIXES:
        return "text"
    return None


def _supported() -> str:
    return ", ".join(SUFFIXES[:-1]) + " or " + SUFFIXES[-1]


def _walk(directory: Path) -> list[Path]:
    """Supported files under `directory`, sorted; hidden files and directories (.git, .cache) are skipped."""
    found = []
    for root, dirs, files in os.walk(directory):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d != "__pycache__"]
        found += [Path(root, f) for f in files if not f.startswith(".") and file_kind(Path(f))]
    return sorted(found)


def _expand(source: str, entry: str, cache: Path | None, text_field: str) -> list[Path]:
    """The files one configured path entry names. Files met inside directories or through a glob are
    filtered by type; an empty one among them (an `__init__.py`) is an empty document, which cleaning
    removes as too short. A file named directly must be readable as it is, and not empty. A URL or a
    Hugging Face dataset is fetched into `cache` first (keel.data.remote)."""
    if entry == BUILTIN_STDLIB:
        return stdlib_files()
    if is_remote(entry):
        if cache is None:
            raise DataError(f"source {source!r}: path {entry!r} is not a local path; `keel data prepare` fetches it")
        return fetch(source, entry, cache, text_field, file_kind)
    entry = entry.removeprefix("file://")
    where = f"source {source!r}: path {shown(entry)}"
    valid = f"give existing files, directories or globs, or '{BUILTIN_STDLIB}'"
    check_name(entry, f"source {source!r}: path", valid, DataError)
    if _GLOB_CHARS.search(entry) and not os.path.lexists(entry):
        return _glob(where, entry)
    path = check_input(entry, f"source {source!r}: path", "any", valid, DataError)
    if path.is_dir():
        return _walk(path)
    if not file_kind(path):
        raise DataError(f"{where} has an unsupported type; supported files end in {_supported()}")
    if path.stat().st_size == 0:
        raise DataError(f"{where} is empty; remove it from the source or give it documents")
    return [path]


def _glob(where: str, pattern: str) -> list[Path]:
    matches = sorted(glob.glob(pattern, recursive=True))
    if not matches:
        raise DataError(f"{where} matches no files; give existing files, directories or globs "
                        f"(*, ?, [...], **), or '{BUILTIN_STDLIB}'")
    found: list[Path] = []
    for match in map(Path, matches):
        if match.is_dir():
            found += _walk(match)
        elif file_kind(match):
            found.append(match)
    return found


def _real_path(path: Path, directories: dict[str, str]) -> str:
    """os.path.realpath(path), resolving each directory once: a file that is not a link is its real directory
    and its name (realpath would look at every component of every file's path again)."""
    if path.name in ("", ".", "..") or path.is_symlink():
        return os.path.realpath(path)
    parent = str(path.parent)
    if parent not in directories:
        directories[parent] = os.path.realpath(parent)
    return os.path.join(directories[parent], path.name)


def _disjoint(a: tuple[int, int], b: tuple[int, int]) -> bool:
    """Whether two (min_chars, max_chars) document-length ranges (0: unbounded above) share no length."""
    return 0 < a[1] < b[0] or 0 < b[1] < a[0]


def resolve_inputs(sources: dict[str, list[str]], cache: Path | None = None, text_field: str = "text",
                   lengths: dict[str, tuple[int, int]] | None = None) -> list[InputFile]:
    """Every input file of every source, sources in the given order and files sorted within each path
    entry. A file reached twice within one source is read once; a file in two sources is an error unless
    their document-length ranges (`lengths`, by source) are disjoint, so that each document goes to one.
    URLs and Hugging Face datasets are fetched into `cache`, their JSON made of `text_field`."""
    inputs: list[InputFile] = []
    owners: dict[str, list[str]] = {}
    directories: dict[str, str] = {}
    span = lengths or {}
    for source, entries in sources.items():
        count = 0
        for entry in entries:
            for path in _expand(source, entry, cache, text_field):
                key = _real_path(path, directories)
                if source in owners.get(key, ()):
                    continue
                for other in owners.get(key, ()):
                    if not _disjoint(span.get(source, (0, 0)), span.get(other, (0, 0))):
                        raise DataError(f"file {str(path)!r} is in source {other!r} and in source {source!r}; "
                                        f"a file may belong to one source only (it would be counted twice), or "
                                        f"to sources of disjoint min_chars..max_chars")
                if not os.access(path, os.R_OK):
                    raise DataError(f"source {source!r}: file {str(path)!r} is not readable (permission denied); "
                                    f"fix its permissions or remove it from the source")
                owners.setdefault(key, []).append(source)
                inputs.append(InputFile(source, path, file_kind(path) or "text"))
                count += path.stat().st_size > 0
        if not count:
            raise DataError(f"source {source!r} (paths {entries}) holds no non-empty {_supported()} files")
    return inputs


def read_documents(f: InputFile, text_field: str, malformed: list[str], repaired: list[str] | None = None
                   ) -> Iterator[str]:
    """Stream the documents of `f`; damaged lines and rows are appended to `malformed`, not raised, and documents
    kept with U+FFFD in place of what was not valid Unicode to `repaired`."""
    repaired = [] if repaired is None else repaired
    if f.kind == "text":
        yield _decoded(f.path, repaired)
    elif f.kind == "jsonl":
        yield from _read_jsonl(f.path, text_field, malformed, repaired)
    elif f.kind == "parquet":
        yield from _read_parquet(f.path, text_field, malformed)
    else:
        raise DataError(f"{f.path}: unknown input kind {f.kind!r}; expected text, jsonl or parquet")


def _decoded(path: Path, repaired: list[str]) -> str:
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        repaired.append(f"{path}: invalid UTF-8 at byte {e.start}")
        return data.decode("utf-8", errors="replace")


def _valid_unicode(text: str) -> str:
    """Lone surrogates cannot be encoded to UTF-8; they become U+FFFD like other undecodable input."""
    if text.isascii():
        return text
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return _SURROGATE.sub("\ufffd", text)
    return text


def _jsonl_line(line: bytes, text_field: str) -> str:
    """The document of one JSON line; ValueError says what is wrong with the line."""
    try:
        record = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(f"invalid UTF-8 at byte {e.start}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"bad JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    if text_field not in record:
        raise ValueError(f"no {text_field!r} field")
    text = record[text_field]
    if not isinstance(text, str):
        raise ValueError(f"field {text_field!r} is {type(text).__name__}, not a string")
    return text


ZSTD_CHUNK = 1 << 20  # compressed bytes read at a time
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"  # the first bytes of a zstd frame
ZSTD_SKIPPABLE = (0x184D2A50, 0x184D2A5F)  # magic numbers of skippable frames (metadata, no data)


class DamagedFile(Exception):
    """A compressed stream that cannot be read to its end; the message says where it breaks, without the path."""


def _zstandard(path: Path) -> Any:
    try:
        import zstandard
    except ImportError:
        raise DataError(f"{path}: reading .jsonl.zst files needs zstandard; pip install 'keel-pretrain[zst]'") \
            from None
    return zstandard


def _zstd_chunks(path: Path) -> Iterator[bytes]:
    """The decompressed bytes of a zstd file, frame after frame. Damage raises DamagedFile naming the compressed
    byte where decompression broke and its frame; so does a file that ends inside a frame, which zstandard's own
    readers end without a word."""
    zstandard = _zstandard(path)
    frame, start, at = 1, 0, 0  # the current frame's number and first byte, the first byte of `chunk`
    decompressor, fed = zstandard.ZstdDecompressor().decompressobj(), False
    with open(path, "rb") as fh:
        while chunk := fh.read(ZSTD_CHUNK):
            while chunk:
                try:
                    out = decompressor.decompress(chunk)
                except zstandard.ZstdError as e:
                    raise DamagedFile(_zstd_failure(path, frame, start, at, chunk, e)) from None
                yield out
                fed = True
                if not decompressor.eof:
                    at += len(chunk)
                    break
                at += len(chunk) - len(decompressor.unused_data)  # the next frame needs a decompressor of its own
                chunk, frame, start, fed = decompressor.unused_data, frame + 1, at, False
                decompressor = zstandard.ZstdDecompressor().decompressobj()
    if fed:
        raise DamagedFile(f"truncated zstd file: it ends at byte {at} inside frame {frame} (from byte {start})")


def _zstd_failure(path: Path, frame: int, start: int, at: int, chunk: bytes, error: Exception) -> str:
    """Where decompression broke: frame `frame` is decoded again from its first byte up to `chunk` (which starts at
    byte `at`), then `chunk` a byte at a time, as a failed decompressor cannot say how far it got."""
    zstandard = _zstandard(path)
    reason = str(error).removeprefix("zstd decompressor error: ")
    with open(path, "rb") as fh:
        fh.seek(start)
        head = fh.read(4)
        magic = int.from_bytes(head.ljust(4, b"\0"), "little")
        if head != ZSTD_MAGIC and not ZSTD_SKIPPABLE[0] <= magic <= ZSTD_SKIPPABLE[1]:
            return f"not zstd data: no zstd frame starts at byte {start} (frame {frame}; it starts with {head!r})"
        fh.seek(start)
        decompressor = zstandard.ZstdDecompressor().decompressobj()
        while (left := at - fh.tell()) > 0 and (piece := fh.read(min(ZSTD_CHUNK, left))):
            decompressor.decompress(piece)  # decoded before without error
        for i in range(len(chunk)):
            try:
                decompressor.decompress(chunk[i:i + 1])
            except zstandard.ZstdError:
                at += i
                break
    return (f"corrupt zstd data: decompression broke at byte {at} of {path.stat().st_size}, in frame {frame} "
            f"(from byte {start}): {reason}")


def _split_lines(chunks: Iterator[bytes]) -> Iterator[bytes]:
    """Lines out of a stream of byte chunks; a line's pieces are joined once, however many chunks it spans."""
    pending: list[bytes] = []
    for out in chunks:
        if b"\n" not in out:
            pending.append(out)
            continue
        first, *lines, last = out.split(b"\n")
        yield b"".join(pending) + first + b"\n"
        yield from (line + b"\n" for line in lines)
        pending = [last]
    if tail := b"".join(pending):
        yield tail


def damage(f: InputFile) -> str | None:
    """Why `f` cannot be read at all, or None: a zstd file is decompressed to its end (its damage may show only in
    a frame's checksum, after every line of the frame was decoded), a Parquet file's footer is opened. Other kinds
    are read as far as they go."""
    try:
        if f.path.name.endswith(".zst"):
            for _ in _zstd_chunks(f.path):
                pass
        elif f.kind == "parquet":
            _parquet_file(f.path)
    except DamagedFile as e:
        return str(e)
    except OSError as e:
        return f"unreadable ({e})"
    return None


def _jsonl_lines(path: Path) -> Iterator[bytes]:
    if path.name.endswith(".zst"):
        yield from _split_lines(_zstd_chunks(path))
        return
    with (gzip.open if path.name.endswith(".gz") else open)(path, "rb") as fh:
        yield from fh


def _read_jsonl(path: Path, text_field: str, malformed: list[str], repaired: list[str]) -> Iterator[str]:
    lineno = 0
    try:
        for lineno, line in enumerate(_jsonl_lines(path), 1):
            if not line.strip():
                continue
            try:
                text = _jsonl_line(line, text_field)
            except ValueError as e:
                malformed.append(f"{path}:{lineno}: {e}")
                continue
            if (valid := _valid_unicode(text)) is not text:
                repaired.append(f"{path}:{lineno}: lone surrogate escapes")
            yield valid
    except (EOFError, OSError, zlib.error, DamagedFile) as e:
        # A truncated or corrupt compressed stream: what came before it is kept, the rest is unreadable.
        reason = str(e) if isinstance(e, DamagedFile) else f"{type(e).__name__}: {e}"
        malformed.append(f"{path}: unreadable after line {lineno} ({reason})")


def _parquet_file(path: Path) -> Any:
    """The opened pyarrow ParquetFile; DamagedFile when its footer cannot be read."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading .parquet files needs pyarrow; pip install 'keel-pretrain[parquet]'") from None
    try:
        return pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise DamagedFile(f"not a readable Parquet file ({e})") from None


def _read_parquet(path: Path, text_field: str, malformed: list[str]) -> Iterator[str]:
    try:
        pf = _parquet_file(path)
    except DamagedFile as e:
        malformed.append(f"{path}: {e}")
        return
    import pyarrow as pa
    schema = pf.schema_arrow
    if text_field not in schema.names:
        shown = ", ".join(schema.names[:10]) + (" ..." if len(schema.names) > 10 else "")
        raise DataError(f"{path}: no column {text_field!r} (columns: {shown}); set data.text_field to the "
                        f"column that holds the text")
    kind = schema.field(text_field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise DataError(f"{path}: column {text_field!r} holds {kind}, expected strings; set data.text_field to "
                        f"the column that holds the text")
    row = 0  # rows are numbered from 0, as pyarrow and pandas number them
    try:
        for batch in pf.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[text_field]):
            for text in batch.column(0).to_pylist():
                if text is None:
                    malformed.append(f"{path}:row {row}: null")
                else:
                    yield text
                row += 1
    except (pa.ArrowException, OSError) as e:
        malformed.append(f"{path}: unreadable from row {row} ({e})")
