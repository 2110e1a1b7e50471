"""`keel data prepare`: sources → clean → dedup → decontaminate → tokenize → fixed-size shards + manifest.

Stages, each leaving a completion marker in a work directory named after everything that decides the output
(the inputs' content and the settings), so that an interrupted prepare resumes where it stopped:

1. scan, one task per run of consecutive input files of a source (about TASK_BYTES), in parallel worker
   processes: read, normalise and clean the documents (a damaged file is skipped whole); keep each survivor's
   text, exact key, split, MinHash signature and decontamination n-gram hashes (all three hashed from one
   normalisation) in the task's work files.
2. dedup, in the main process: exact duplicates (first occurrence kept), then MinHash-LSH near duplicates
   (union-find, the cluster's first document kept), across all sources and both splits.
3. tokenizer: byte, a given tokenizer.json, or BPE trained on the deduplicated training documents.
4. encode, the same tasks in the same worker processes: drop training documents that share a long n-gram with
   the validation split or the evaluation files, and tokenize the rest.
5. shards, in the main process: every source's tokens, in input order, cut into files of `shard_tokens` tokens.

Documents are always visited in input order and every choice is a function of content, so the output is
byte-identical whatever the number of workers and however often the prepare was interrupted. The output
directory appears complete or not at all: it is assembled in a temporary directory and renamed into place.
"""

from __future__ import annotations

import dataclasses
import fcntl
import functools
import hashlib
import json
import math
import mmap
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import ExitStack
from pathlib import Path

import numpy as np

from keel.config import DataConfig
from keel.data.clean import Cleaner, merge_stats
from keel.data.dedup import (
    MinHasher,
    lsh_formula,
    lsh_params,
    near_duplicate_roots,
    ngram_hashes,
    scan_hashes,
)
from keel.data.shards import FORMAT_VERSION, MANIFEST, ShardWriter, read_manifest, sha256_file, token_dtype
from keel.data.sources import BUILTIN_STDLIB, InputFile, damage, read_documents, resolve_inputs, stdlib_files
from keel.data.stats import STATS, plural
from keel.data.tokenizer import ByteTokenizer, Tokenizer, open_tokenizer, parse_tokenizer_spec, train_bpe
from keel.data.workers import Progress, Workers
from keel.errors import DataError

__all__ = ["BUILTIN_STDLIB", "describe", "is_validation", "prepare", "stdlib_files", "unigram_entropy"]

SIGNATURE_BATCH = 512  # documents hashed together: amortises numpy's per-call cost, bounds memory
BATCH_BYTES = 4 << 20  # ... and at most about this much text, whatever the documents' lengths
TASK_BYTES = 2 << 20  # a task takes consecutive input files of one source until it holds this many bytes: a task's
# work files and markers cost a few file creations, which would outweigh the work on a corpus of small files
MALFORMED_SHOWN = 20  # malformed lines listed by file:line in the stats, and files by count (all are counted)
SKIPPED_SHOWN = 20  # skipped files named by `describe` (the manifest and the stats name all)
SPLITS = ("train", "val")
COPY_TOKENS = 1 << 24  # tokens copied into the shards at a time: memory stays flat whatever an input's size
COUNT_TOKENS = 1 << 16  # tokens counted at a time (their 64-bit copy stays in the cache)
LENGTH_BINS = [0, 64, 256, 1024, 4096, 16384, 65536, 262144, 1 << 62]  # histogram of kept documents, in tokens

# One record per kept document in a task's .meta file: text offset, text length, exact key, validation flag, the
# index of its input file and its number of decontamination n-grams (whose hashes the .grams file holds).
META = np.dtype([("offset", "<u8"), ("length", "<u8"), ("key", "V16"), ("val", "u1"), ("input", "<u4"),
                 ("grams", "<u8")])
WORK_LAYOUT = 3  # in the work directory's name: a prepare never resumes from work files laid out otherwise


def is_validation(doc: bytes, val_fraction: float) -> bool:
    """Deterministic hold-out by document content: the same document always lands in the same split."""
    bucket = int.from_bytes(hashlib.sha256(doc).digest()[:8], "little") % 1_000_000
    return bucket < val_fraction * 1_000_000


def unigram_entropy(counts: np.ndarray) -> float:
    """Entropy in nats of the token frequencies: the loss of a model that learns only frequencies."""
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


# ---------------------------------------------------------------- settings and work directory

def _settings(data: DataConfig) -> dict:
    """Everything that decides the output, and nothing that does not (the number of workers)."""
    settings = {"format_version": FORMAT_VERSION,
                "sources": {name: s.paths for name, s in data.sources.items()},
                "tokenizer": data.tokenizer, "val_fraction": data.val_fraction, "text_field": data.text_field,
                "shard_tokens": data.shard_tokens, "clean": dataclasses.asdict(data.clean),
                "dedup": dataclasses.asdict(data.dedup), "decontam": dataclasses.asdict(data.decontam)}
    # Only where a source is bounded, so that a corpus prepared before the bounds existed keeps its fingerprint.
    lengths = {name: [s.min_chars, s.max_chars] for name, s in data.sources.items() if s.min_chars or s.max_chars}
    return settings | ({"lengths": lengths} if lengths else {})


def _content_fingerprint(settings: dict, inputs: list[InputFile], evals: list[InputFile],
                         tokenizer_file: Path | None) -> str:
    h = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
    for f in [*inputs, *evals]:
        h.update(f"{f.source}\0{f.path.name}\0{sha256_file(f.path)}\0".encode())
    if tokenizer_file is not None:
        h.update(sha256_file(tokenizer_file).encode())
    return h.hexdigest()


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _mark(path: Path, record: dict) -> None:
    _atomic_write(path, json.dumps(record, sort_keys=True).encode())


def _marked(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _marks(work: Path, stage: str, count: int) -> list[dict]:
    """The records every task of `stage` marked done with (all of them ran)."""
    return [json.loads((work / f"{i:06d}.{stage}").read_text()) for i in range(count)]


# ---------------------------------------------------------------- tasks

@dataclasses.dataclass(frozen=True)
class _Task:
    """Consecutive input files of one source, scanned and encoded together; `first` is the first one's index."""

    index: int
    first: int
    files: tuple[InputFile, ...]

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def source(self) -> str:
        return self.files[0].source


def tasks_of(inputs: list[InputFile]) -> list[_Task]:
    """The inputs cut into tasks of about TASK_BYTES, a source's files never mixed with another's. The cut depends
    on the inputs alone (not on the number of workers), so a resumed prepare finds the tasks it marked done."""
    tasks: list[_Task] = []
    start, size = 0, 0
    for i, f in enumerate(inputs):
        if i > start and (size >= TASK_BYTES or f.source != inputs[start].source):
            tasks.append(_Task(len(tasks), start, tuple(inputs[start:i])))
            start, size = i, 0
        size += f.size
    if inputs:
        tasks.append(_Task(len(tasks), start, tuple(inputs[start:])))
    return tasks


# ---------------------------------------------------------------- stage 1: scan

@dataclasses.dataclass
class _Unused:
    """What a task's inputs held that could not be used as it was: malformed lines and rows (`path:line N: reason`),
    counted per file, the damaged files, skipped whole, and the documents kept with U+FFFD in place of what was not
    valid Unicode; and the documents outside the source's length range, which are another source's (sources that
    split files by length)."""

    lengths: tuple[float, float] = (0, math.inf)
    outside: int = 0
    malformed: list[str] = dataclasses.field(default_factory=list)
    malformed_files: list[list] = dataclasses.field(default_factory=list)  # [path, count] per file with any
    skipped: list[dict] = dataclasses.field(default_factory=list)  # source, path, reason
    undecodable: list[str] = dataclasses.field(default_factory=list)

    def documents(self, f: InputFile, text_field: str) -> Iterator[str]:
        """`f`'s documents; none of a damaged file, whose text may be wrong before the damage shows."""
        if (reason := damage(f)) is not None:
            self.skipped.append({"source": f.source, "path": str(f.path), "reason": reason})
            return
        before = len(self.malformed)
        low, high = self.lengths
        for text in read_documents(f, text_field, self.malformed, self.undecodable):
            if low <= len(text) <= high:
                yield text
            else:
                self.outside += 1
        if len(self.malformed) > before:
            self.malformed_files.append([str(f.path), len(self.malformed) - before])

    def record(self) -> dict:
        return {"outside_length": self.outside,
                "malformed": len(self.malformed), "malformed_shown": self.malformed[:MALFORMED_SHOWN],
                "malformed_files": self.malformed_files, "skipped": self.skipped,
                "undecodable": len(self.undecodable), "undecodable_shown": self.undecodable[:MALFORMED_SHOWN]}


def _scan_task(task: _Task, work: Path, data: DataConfig) -> None:
    """Clean one task's documents; write their text, metadata and MinHash signatures; mark it done."""
    marker = work / f"{task.index:06d}.scan"
    if marker.is_file():
        return
    source = data.sources[task.source]
    cleaner = Cleaner(data.clean)
    unused = _Unused(lengths=(source.min_chars, source.max_chars or math.inf))
    hasher = MinHasher(data.dedup.num_perm, data.dedup.seed, data.dedup.shingle, data.dedup.ngram)
    part = f".{os.getpid()}.tmp"
    paths = {kind: work / f"{task.index:06d}.{kind}" for kind in ("text", "meta", "sig", "grams")}
    tmp = {kind: p.with_name(p.name + part) for kind, p in paths.items()}
    documents = source_bytes = 0
    with ExitStack() as stack:
        out = {kind: stack.enter_context(open(path, "wb")) for kind, path in tmp.items()}
        text_out = out["text"]
        batch: list[str] = []
        metas: list[tuple] = []
        batch_bytes = offset = 0

        def flush() -> None:
            if batch:
                hashed = scan_hashes(batch, hasher if data.dedup.near else None,
                                     data.decontam.ngram if data.decontam.enabled else 0)
                out["sig"].write(np.ascontiguousarray(hashed.signatures, dtype="<u4").tobytes())
                out["grams"].write(hashed.grams.astype("<u8", copy=False).tobytes())
                records = np.array(metas, dtype=META)
                records["key"] = np.array(hashed.keys, dtype="V16")
                records["grams"] = hashed.gram_counts
                out["meta"].write(records.tobytes())
                batch.clear()
                metas.clear()

        for index, f in enumerate(task.files, task.first):
            for number, text in enumerate(unused.documents(f, data.text_field)):
                documents += 1
                body = text.encode("utf-8")
                source_bytes += len(body)
                cleaned, _ = cleaner.clean(text, f.is_code, f"{f.path}#{number}")
                if cleaned is None:
                    continue
                if cleaned is not text:
                    body = cleaned.encode("utf-8")
                text_out.write(body)
                metas.append((offset, len(body), b"", is_validation(body, data.val_fraction), index, 0))
                offset += len(body)
                batch.append(cleaned)
                batch_bytes += len(body)
                if len(batch) >= SIGNATURE_BATCH or batch_bytes >= BATCH_BYTES:
                    flush()
                    batch_bytes = 0
        flush()
    for kind in paths:
        os.replace(tmp[kind], paths[kind])
    _mark(marker, {"documents": documents, "source_bytes": source_bytes, **unused.record(),
                   "clean": cleaner.stats()})


def _texts(work: Path, index: int, meta: np.ndarray, rows: np.ndarray) -> Iterator[tuple[int, str]]:
    """(row, text) of a task's kept documents `rows`, read from its text file through a memory map (the file may
    be larger than memory; one read call per document would cost more than the decoding)."""
    path = work / f"{index:06d}.text"
    if not len(rows) or not path.stat().st_size:
        yield from ((int(row), "") for row in rows)
        return
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as text:
        offsets, lengths = meta["offset"][rows].tolist(), meta["length"][rows].tolist()
        for row, start, length in zip(rows.tolist(), offsets, lengths, strict=True):
            yield row, text[start:start + length].decode("utf-8", errors="replace")


def _origin(files: Sequence[InputFile], first: int, meta: np.ndarray, row: int) -> str:
    """`path#n` of a task's kept document `row`: n counts the kept documents of its input file. `files` are the
    inputs from input number `first` on (all of them, or a task's own)."""
    index = int(meta["input"][row])
    return f"{files[index - first].path}#{row - int(np.searchsorted(meta['input'], index))}"


def _read_meta(work: Path, index: int) -> np.ndarray:
    return np.fromfile(work / f"{index:06d}.meta", dtype=META)


# ---------------------------------------------------------------- stage 2: dedup

def _dedup(work: Path, tasks: list[_Task], inputs: list[InputFile], data: DataConfig) -> dict:
    """Decide which documents survive deduplication: writes `keep.npy` (one flag per scanned document, in input
    order) and the counts. Exact duplicates first; near duplicates among the rest."""
    marker = work / "dedup.done"
    if (done := _marked(marker)) is not None:
        return done
    metas = [_read_meta(work, t.index) for t in tasks]
    keys = np.concatenate([m["key"] for m in metas]) if metas else np.empty(0, dtype="V16")
    total = len(keys)
    alive = np.zeros(total, dtype=bool)
    first_of = np.arange(total)  # the document each exact duplicate repeats
    if data.dedup.exact and total:
        _, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
        alive[first] = True
        first_of = first[inverse.ravel()]
    else:
        alive[:] = True
    exact = int(total - alive.sum())
    dc = data.dedup
    bands, rows = (dc.bands, dc.rows) if dc.bands and dc.rows else lsh_params(dc.threshold, dc.num_perm)
    near, near_dup, roots = 0, np.zeros(total, dtype=bool), np.arange(total)
    if dc.near and total:
        signatures = _signatures(work, len(tasks), total, dc.num_perm)
        roots = near_duplicate_roots(signatures, bands, rows, dc.threshold, alive)
        near_dup = alive & (roots != np.arange(total))
        near = int(near_dup.sum())
        alive &= ~near_dup
        np.save(work / "roots.npy", roots)
    np.save(work / "keep.npy", alive)
    samples = {"exact_duplicate": _samples(work, inputs, metas, np.nonzero(~alive & ~near_dup)[0], first_of,
                                           data.clean.samples),
               "near_duplicate": _samples(work, inputs, metas, np.nonzero(near_dup)[0], roots, data.clean.samples)}
    record = {"documents": total, "exact_duplicates": exact, "near_duplicates": near, "samples": samples,
              "lsh": {"threshold": dc.threshold, "num_perm": dc.num_perm, "bands": bands, "rows": rows,
                      "shingle": f"{dc.shingle} {dc.ngram}-grams", "formula": lsh_formula(bands, rows)}}
    _mark(marker, record)
    return record


def _samples(work: Path, inputs: list[InputFile], metas: list[np.ndarray], removed: np.ndarray, kept: np.ndarray,
             limit: int) -> list[dict]:
    """The first `limit` removed documents, each with the origin of the document that was kept instead."""
    bounds = np.concatenate([[0], np.cumsum([len(m) for m in metas])]).astype(np.int64)

    def locate(doc: int) -> tuple[int, int]:
        i = int(np.searchsorted(bounds, doc, side="right") - 1)
        return i, doc - int(bounds[i])

    out = []
    for doc in removed[:limit]:
        i, row = locate(int(doc))
        ki, krow = locate(int(kept[doc]))
        (_, text), = _texts(work, i, metas[i], np.array([row]))
        out.append({"origin": _origin(inputs, 0, metas[i], row), "kept": _origin(inputs, 0, metas[ki], krow),
                    "text": text[:2000]})
    return out


def _signatures(work: Path, n_tasks: int, total: int, num_perm: int) -> np.ndarray:
    """All signatures as one memmap, (documents, num_perm), built by appending the tasks' files."""
    path = work / "signatures.u4"
    if not path.is_file() or path.stat().st_size != total * num_perm * 4:
        tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
        with open(tmp, "wb") as out:
            for i in range(n_tasks):
                with open(work / f"{i:06d}.sig", "rb") as f:
                    shutil.copyfileobj(f, out, 1 << 22)
        os.replace(tmp, path)
    return np.memmap(path, dtype="<u4", mode="r", shape=(total, num_perm))


def _keep_slices(work: Path, tasks: list[_Task]) -> list[np.ndarray]:
    """Per task, the rows of its scanned documents that survived deduplication."""
    keep = np.load(work / "keep.npy")
    sizes = [len(_read_meta(work, t.index)) for t in tasks]
    bounds = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    return [np.nonzero(keep[bounds[i]:bounds[i + 1]])[0] for i in range(len(tasks))]


# ---------------------------------------------------------------- stage 3: tokenizer

def _tokenizer(work: Path, keep: list[np.ndarray], data: DataConfig) -> Tokenizer:
    spec = parse_tokenizer_spec(data.tokenizer)
    marker = work / "tokenizer.done"
    match spec:
        case ("byte", _):
            tokenizer = open_tokenizer(work, {"name": "byte"})
            _mark(marker, tokenizer.describe())
            return tokenizer
        case ("file", path):
            shutil.copyfile(path, work / "tokenizer.json")
        case ("bpe", vocab) if _marked(marker) is None:
            def training_texts() -> Iterator[str]:
                for i, rows in enumerate(keep):
                    meta = _read_meta(work, i)
                    rows = rows[meta["val"][rows] == 0]
                    for _, text in _texts(work, i, meta, rows):
                        yield text

            train_bpe(training_texts(), vocab).save(work)
    tokenizer = open_tokenizer(work, {"name": spec[0], "file": "tokenizer.json",
                                      "sha256": sha256_file(work / "tokenizer.json")})
    _mark(marker, tokenizer.describe())
    return tokenizer


# ---------------------------------------------------------------- stage 4: encode

def _encode_task(task: _Task, work: Path, data: DataConfig, rows: np.ndarray) -> None:
    """Tokenize one task's surviving documents, dropping contaminated training ones; writes per split a token file
    and the documents' token counts, and marks the task done. (It gets its own files, not the list of all inputs:
    that list, pickled for every task sent to a worker, cost time quadratic in the number of files.)"""
    marker = work / f"{task.index:06d}.encode"
    if marker.is_file():
        return
    tokenizer = _cached_tokenizer(work, (work / "tokenizer.done").read_text())
    banned = _banned(work) if data.decontam.enabled else None
    meta = _read_meta(work, task.index)
    grams = _TaskGrams(work, task.index, meta) if banned is not None and len(banned) else None
    dtype = token_dtype(tokenizer.vocab_size)
    part = f".{os.getpid()}.tmp"
    outputs = {split: (work / f"{task.index:06d}.{split}.tok", work / f"{task.index:06d}.{split}.len")
               for split in SPLITS}
    contaminated = 0
    samples: list[dict] = []
    with ExitStack() as stack:
        files = {split: (stack.enter_context(open(a.with_name(a.name + part), "wb")),
                         stack.enter_context(open(b.with_name(b.name + part), "wb")))
                 for split, (a, b) in outputs.items()}
        text = stack.enter_context(_TaskText(work / f"{task.index:06d}.text"))
        for batch in np.array_split(rows, np.flatnonzero(_batch_starts(meta["length"][rows]))[1:]):
            is_val = meta["val"][batch].astype(bool)
            dropped = np.zeros(len(batch), dtype=bool)
            if grams is not None and banned is not None:
                dropped[~is_val] = grams.contaminated(batch[~is_val], banned)
            for row in batch[dropped][: max(0, data.clean.samples - len(samples))].tolist():
                samples.append({"origin": _origin(task.files, task.first, meta, row),
                                "text": text.document(meta, row)[:2000]})
            contaminated += int(dropped.sum())
            for split, chosen in (("train", ~is_val & ~dropped), ("val", is_val)):
                if chosen.any():
                    tokens, lengths = _tokens(tokenizer, text, meta, batch[chosen], dtype)
                    tok_out, len_out = files[split]
                    tok_out.write(tokens.tobytes())
                    len_out.write(lengths.astype("<u8").tobytes())
    for a, b in outputs.values():
        os.replace(a.with_name(a.name + part), a)
        os.replace(b.with_name(b.name + part), b)
    _mark(marker, {"contaminated": contaminated, "samples": samples})


def _batch_starts(lengths: np.ndarray) -> np.ndarray:
    """Where batches of at most SIGNATURE_BATCH documents and about BATCH_BYTES of text start (a mask)."""
    starts = np.zeros(len(lengths), dtype=bool)
    size = count = 0
    for i, length in enumerate(lengths.tolist()):
        if count >= SIGNATURE_BATCH or size >= BATCH_BYTES:
            starts[i] = True
            size = count = 0
        size += length
        count += 1
    if len(starts):
        starts[0] = True
    return starts


class _TaskText:
    """A task's text file, memory-mapped (it may be larger than memory)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.map: mmap.mmap | None = None

    def __enter__(self) -> _TaskText:
        if self.path.stat().st_size:
            with open(self.path, "rb") as f:
                self.map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.map is not None:
            self.map.close()

    def utf8(self, meta: np.ndarray, row: int) -> bytes:
        start = int(meta["offset"][row])
        return self.map[start:start + int(meta["length"][row])] if self.map is not None else b""

    def document(self, meta: np.ndarray, row: int) -> str:
        return self.utf8(meta, row).decode("utf-8", errors="replace")


def _tokens(tokenizer: Tokenizer, text: _TaskText, meta: np.ndarray, rows: np.ndarray,
            dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """The documents `rows` tokenized and concatenated, and each one's token count. The byte tokenizer's ids are
    the text's UTF-8 bytes (the scan wrote valid UTF-8), framed by BOS and EOS: they are copied from the text file
    as they are, with no decoding and encoding again."""
    if not isinstance(tokenizer, ByteTokenizer):
        encoded = tokenizer.encode_documents([text.document(meta, row) for row in rows.tolist()])
        return np.concatenate(encoded).astype(dtype), np.array([len(e) for e in encoded], dtype=np.int64)
    lengths = meta["length"][rows].astype(np.int64) + 2
    ends = np.cumsum(lengths)
    out = np.empty(int(ends[-1]) if len(ends) else 0, dtype=dtype)
    out[ends - lengths] = tokenizer.bos
    out[ends - 1] = tokenizer.eos
    for end, row, length in zip(ends.tolist(), rows.tolist(), lengths.tolist(), strict=True):
        out[end - length + 1:end - 1] = np.frombuffer(text.utf8(meta, row), dtype=np.uint8)
    return out, lengths


@functools.lru_cache(maxsize=2)
def _cached_tokenizer(work: Path, described: str) -> Tokenizer:
    """A worker loads the tokenizer once, not once per input file (a BPE file takes tens of milliseconds)."""
    return open_tokenizer(work, json.loads(described))


class _NgramSet:
    """Sorted n-gram hashes behind a table of their top bits: almost every n-gram of a training document is not
    in the set, and a table lookup tells so for the cost of one gather, where a binary search over the whole set
    would take a dozen dependent reads. Only what the table lets through is searched."""

    def __init__(self, hashes: np.ndarray) -> None:
        self.hashes = np.asarray(hashes)
        bits = int(np.clip(np.ceil(np.log2(max(1, len(self.hashes)) * 64)), 16, 24))  # ~1/64 let through
        self.shift = np.uint64(64 - bits)
        self.table = np.zeros(1 << bits, dtype=bool)
        self.table[self.hashes >> self.shift] = True

    def __len__(self) -> int:
        return len(self.hashes)

    def contains(self, grams: np.ndarray) -> np.ndarray:
        found = np.zeros(len(grams), dtype=bool)
        maybe = np.flatnonzero(self.table[grams >> self.shift])
        if len(maybe):
            at = np.searchsorted(self.hashes, grams[maybe]).clip(max=len(self.hashes) - 1)
            found[maybe] = self.hashes[at] == grams[maybe]
        return found


@functools.lru_cache(maxsize=2)
def _banned(work: Path) -> _NgramSet:
    """The contamination set, loaded once per worker (it is fixed once the contamination stage is done)."""
    return _NgramSet(np.load(work / "contamination.npy"))


class _TaskGrams:
    """A task's decontamination n-gram hashes as the scan wrote them (memory-mapped): looking them up costs a
    gather, where hashing the documents again cost more than all the rest of the encoding."""

    def __init__(self, work: Path, index: int, meta: np.ndarray) -> None:
        path = work / f"{index:06d}.grams"
        self.hashes = np.memmap(path, dtype="<u8", mode="r") if path.stat().st_size else np.zeros(0, np.uint64)
        self.counts = meta["grams"].astype(np.int64)
        self.starts = np.concatenate(([0], np.cumsum(self.counts)[:-1])).astype(np.int64)

    def contaminated(self, rows: np.ndarray, banned: _NgramSet) -> np.ndarray:
        """Which of the documents `rows` share a word n-gram with `banned`."""
        counts = self.counts[rows]
        owner = np.repeat(np.arange(len(rows)), counts)
        at = np.arange(len(owner)) - np.repeat(np.cumsum(counts) - counts, counts) + self.starts[rows][owner]
        return np.bincount(owner[banned.contains(np.asarray(self.hashes[at]))], minlength=len(rows)) > 0


def _contamination_set(work: Path, keep: list[np.ndarray], evals: list[InputFile], data: DataConfig) -> dict:
    """The sorted n-gram hashes that training documents must not share: those of the kept validation documents
    and of the evaluation files."""
    marker = work / "contamination.done"
    if (done := _marked(marker)) is not None:
        return done
    grams: list[np.ndarray] = []
    n = data.decontam.ngram
    for i, rows in enumerate(keep):
        meta = _read_meta(work, i)
        for _, text in _texts(work, i, meta, rows[meta["val"][rows] == 1]):
            grams.append(ngram_hashes(text, n))
    malformed: list[str] = []
    eval_documents = 0
    for f in evals:
        for text in read_documents(f, data.text_field, malformed):
            eval_documents += 1
            grams.append(ngram_hashes(text, n))
    banned = np.unique(np.concatenate(grams)) if grams else np.empty(0, dtype=np.uint64)
    np.save(work / "contamination.npy", banned)
    record = {"n": n, "ngrams": int(len(banned)), "eval_files": len(evals), "eval_documents": eval_documents}
    _mark(marker, record)
    return record


# ---------------------------------------------------------------- stage 5: shards

def _write_shards(work: Path, tmp: Path, tasks: list[_Task], data: DataConfig, dtype: np.dtype,
                  tokenizer: Tokenizer) -> tuple[list[dict], dict]:
    """Cut every source's tokens (tasks in order) into files of `shard_tokens` tokens; returns the file entries
    and per source and split: documents, tokens, text bytes, token counts and document lengths."""
    vocab_size, token_bytes = tokenizer.vocab_size, tokenizer.token_bytes()
    entries: list[dict] = []
    totals: dict = {}
    for source in data.sources:
        for split in SPLITS:
            counts = np.zeros(vocab_size, dtype=np.int64)
            lengths: list[np.ndarray] = []
            writer = ShardWriter(tmp, f"{source}-{split}", source, split, dtype, data.shard_tokens, entries)
            for task in tasks:
                if task.source != source:
                    continue
                i = task.index
                lengths.append(np.fromfile(work / f"{i:06d}.{split}.len", dtype="<u8"))
                with open(work / f"{i:06d}.{split}.tok", "rb") as tok_file:
                    while len(tokens := np.fromfile(tok_file, dtype=dtype, count=COPY_TOKENS)):
                        for at in range(0, len(tokens), COUNT_TOKENS):  # bincount widens to int64: cache-sized
                            counts += np.bincount(tokens[at:at + COUNT_TOKENS], minlength=vocab_size)[:vocab_size]
                        writer.write(tokens)
            writer.close()
            doc_lengths = np.concatenate(lengths) if lengths else np.empty(0, dtype="<u8")
            totals[(source, split)] = {"documents": int(len(doc_lengths)), "tokens": writer.written,
                                       "bytes": int(counts @ token_bytes), "counts": counts, "lengths": doc_lengths}
    return entries, totals


# ---------------------------------------------------------------- the whole prepare

def prepare(data: DataConfig, out: str | Path, force: bool = False, progress: bool = False) -> dict:
    """Build the corpus at `out` and return its manifest. An existing corpus built from the same inputs and
    settings is kept as it is; a different one is replaced only with `force`, and only once the new one is
    complete; `force` never rebuilds an identical one. Concurrent calls for the same `out` (every worker of a job
    started by an external launcher) prepare it once."""
    out = Path(out)
    parse_tokenizer_spec(data.tokenizer)
    cache = out.parent / f".{out.name}.sources"  # URLs and Hugging Face datasets, fetched (keel.data.remote)
    inputs = resolve_inputs({name: s.paths for name, s in data.sources.items()}, cache, data.text_field,
                            {name: (s.min_chars, s.max_chars) for name, s in data.sources.items()})
    evals = resolve_inputs({"eval": data.decontam.eval_files}, cache, data.text_field) \
        if data.decontam.eval_files else []
    _check_readable(inputs, evals)
    check_two_documents(inputs)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _prepare_locked(data, inputs, evals, out, force, progress)


def _check_readable(inputs: list[InputFile], evals: list[InputFile]) -> None:
    """Refuse, before anything is written, a source of which no file can be read (it would give nothing) and a
    damaged evaluation file (decontamination would miss its n-grams). A source's files are checked in order up to
    the first readable one, so a healthy source costs one check; the scan skips the damaged files that remain."""
    for f in evals:
        if (reason := damage(f)) is not None:
            raise DataError(f"{f.path}: {reason}; repair it or remove it from data.decontam.eval_files")
    sources: dict[str, list[InputFile]] = {}
    for f in inputs:
        sources.setdefault(f.source, []).append(f)
    for source, files in sources.items():
        damaged: list[str] = []
        for f in files:
            if (reason := damage(f)) is None:
                break
            damaged.append(f"{f.path}: {reason}")
        else:
            if len(files) == 1:
                raise DataError(f"{damaged[0]}; it is the only file of source {source!r}, so nothing can be "
                                f"prepared: repair or replace it")
            shown = "; ".join(damaged[:3]) + (f"; and {len(damaged) - 3} more" if len(damaged) > 3 else "")
            raise DataError(f"source {source!r}: none of its {len(files)} files can be read ({shown}); "
                            f"repair or replace them")


def check_two_documents(inputs: list[InputFile]) -> None:
    """A corpus needs a training and a validation document: refused before anything is written when the
    inputs cannot hold two (a text file is one document; a .jsonl or .parquet file may hold many)."""
    if len(inputs) == 1 and inputs[0].kind == "text":
        raise DataError(f"the sources hold one document, the text file {str(inputs[0].path)!r}; a corpus needs at "
                        f"least a training and a validation document: give more files (a directory or a glob) or "
                        f"a .jsonl or .parquet file of documents")


def _prepare_locked(data: DataConfig, inputs: list[InputFile], evals: list[InputFile], out: Path, force: bool,
                    progress: bool) -> dict:
    spec = parse_tokenizer_spec(data.tokenizer)
    settings = _settings(data)
    fingerprint = _content_fingerprint(settings, inputs, evals, spec[1] if spec[0] == "file" else None)
    existing = _existing_corpus(out, fingerprint, force)
    if existing is not None:
        return existing
    work = out.parent / f".{out.name}.work-{fingerprint[:16]}-{WORK_LAYOUT}"
    work.mkdir(exist_ok=True)
    stages = _run_stages(work, data, inputs, evals, progress)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    try:
        manifest = _write_corpus(tmp, work, data, inputs, stages, settings, fingerprint)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, DataError):  # these inputs and settings give no corpus: no run resumes this work
            shutil.rmtree(work, ignore_errors=True)
        raise
    _publish(tmp, out)
    shutil.rmtree(work, ignore_errors=True)
    return manifest


def _existing_corpus(out: Path, fingerprint: str, force: bool) -> dict | None:
    """The manifest of the corpus already at `out` when it was prepared the same way; None when `out` is free
    to (re)build. Refuses to replace another corpus without `force`, and anything that is not a corpus."""
    if (out / MANIFEST).exists():
        try:
            existing = json.loads((out / MANIFEST).read_text())
        except json.JSONDecodeError:
            existing = {}  # damaged: another corpus as far as replacing it goes
        if existing.get("prepare_fingerprint") == fingerprint:
            return read_manifest(out)
        if not force:
            raise DataError(f"{str(out)!r} already holds a corpus prepared from other sources or settings; "
                            f"choose another --out or pass --force to replace it")
    elif out.exists() and any(out.iterdir()):
        raise DataError(f"{str(out)!r} exists and is not a prepared corpus; choose an empty or new --out directory")
    return None


@dataclasses.dataclass
class _Stages:
    """What stages 1 to 4 leave for the shards and the stats."""

    scans: list[dict]
    dedup: dict
    tokenizer: Tokenizer
    contamination: dict | None
    encodes: list[dict]


def _run_stages(work: Path, data: DataConfig, inputs: list[InputFile], evals: list[InputFile],
                progress: bool) -> _Stages:
    workers = data.workers or min(8, os.cpu_count() or 1)
    tasks = tasks_of(inputs)
    total_bytes = sum(t.size for t in tasks)
    with Workers(workers) as pool:
        bar = Progress("clean and hash", total_bytes, progress)
        pool.run(_scan_task, [(t, work, data) for t in tasks], bar)
        bar.finish()
        scans = _marks(work, "scan", len(tasks))
        if progress:
            print("deduplicating ...", file=sys.stderr, flush=True)
        dedup = _dedup(work, tasks, inputs, data)
        keep = _keep_slices(work, tasks)
        tokenizer = _tokenizer(work, keep, data)
        contamination = _contamination_set(work, keep, evals, data) if data.decontam.enabled else None
        bar = Progress("decontaminate and tokenize", total_bytes, progress)
        pool.run(_encode_task, [(t, work, data, keep[t.index]) for t in tasks], bar)
        bar.finish()
    return _Stages(scans, dedup, tokenizer, contamination, _marks(work, "encode", len(tasks)))


def _write_corpus(tmp: Path, work: Path, data: DataConfig, inputs: list[InputFile], stages: _Stages,
                  settings: dict, fingerprint: str) -> dict:
    """Stage 5 into `tmp`: the shards, the tokenizer, the stats, the removed samples and the manifest."""
    tokenizer = stages.tokenizer
    dtype = token_dtype(tokenizer.vocab_size)
    entries, totals = _write_shards(work, tmp, tasks_of(inputs), data, dtype, tokenizer)
    tokenizer.save(tmp)
    stats = _stats(inputs, stages.scans, stages.dedup, stages.encodes, totals, tokenizer, stages.contamination)
    for split in SPLITS:
        if not any(totals[(s, split)]["documents"] for s in data.sources):
            raise DataError(f"sources {', '.join(data.sources)} give {stats['documents']['train']} training and "
                            f"{stats['documents']['val']} validation documents after cleaning and dedup; both "
                            f"splits need at least one (more documents or another data.val_fraction)"
                            f"{_unused_note(stats)}")
    _write_removed(tmp, stages.scans, stages.dedup, stages.encodes, data.clean.samples)
    corpus_fp = hashlib.sha256(json.dumps([tokenizer.describe(), [e["sha256"] for e in entries]])
                               .encode()).hexdigest()
    manifest = {
        "format_version": FORMAT_VERSION,
        "sources": {name: {"paths": s.paths, "files": sum(f.source == name for f in inputs)}
                    for name, s in data.sources.items()},
        "source_files": len(inputs),
        "source_bytes": stats["source_bytes"],
        "prepare_fingerprint": fingerprint,
        "settings": settings,
        "tokenizer": tokenizer.describe(),
        "dtype": dtype.name,
        "val_fraction": data.val_fraction,
        "documents": stats["documents"],
        "tokens": stats["tokens"],
        "text_bytes": stats["text_bytes"],  # the UTF-8 bytes the tokens stand for: bits per byte
        "files": entries,
        "fingerprint": corpus_fp,
        "stats": {"unigram_entropy_nats": stats["unigram_entropy_nats"],
                  "tokens_per_byte": stats["tokens_per_byte"]},
        "malformed": {"records": stats["malformed"], "files": stats["malformed_files"]},
        "skipped_files": stats["skipped_files"],  # damaged inputs, none of whose documents are in the corpus
    }
    (tmp / STATS).write_text(json.dumps(stats, indent=1) + "\n")
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def _stats(inputs: list[InputFile], scans: list[dict], dedup: dict, encodes: list[dict], totals: dict,
           tokenizer: Tokenizer, contamination: dict | None) -> dict:
    clean = merge_stats([s["clean"] for s in scans])
    split_docs = {split: sum(v["documents"] for (_, s), v in totals.items() if s == split) for split in SPLITS}
    split_tokens = {split: sum(v["tokens"] for (_, s), v in totals.items() if s == split) for split in SPLITS}
    split_bytes = {split: sum(v["bytes"] for (_, s), v in totals.items() if s == split) for split in SPLITS}
    counts = sum(v["counts"] for (_, s), v in totals.items() if s == "train")
    lengths = np.concatenate([v["lengths"] for v in totals.values()])
    histogram, _ = np.histogram(lengths, bins=LENGTH_BINS)
    source_bytes = sum(s["source_bytes"] for s in scans)
    sources: dict = {}
    for (name, split), v in totals.items():
        sources.setdefault(name, {"files": sum(f.source == name for f in inputs)})
        sources[name][f"{split}_documents"] = v["documents"]
        sources[name][f"{split}_tokens"] = v["tokens"]
    return {
        "documents_in": sum(s["documents"] for s in scans),
        # Documents a source left to another by their length (data.sources.NAME.min_chars and max_chars).
        "outside_source_length": sum(s.get("outside_length", 0) for s in scans),
        "documents_out": split_docs["train"] + split_docs["val"],
        "documents": split_docs,
        "tokens": split_tokens,
        "text_bytes": split_bytes,
        "source_bytes": source_bytes,
        "malformed": sum(s["malformed"] for s in scans),
        "malformed_lines": [line for s in scans for line in s["malformed_shown"]][:MALFORMED_SHOWN],
        "malformed_files": sum(len(s["malformed_files"]) for s in scans),
        "malformed_by_file": [{"path": path, "count": n} for s in scans
                              for path, n in s["malformed_files"]][:MALFORMED_SHOWN],
        "skipped_files": [skipped for s in scans for skipped in s["skipped"]],
        "undecodable": sum(s["undecodable"] for s in scans),
        "undecodable_documents": [doc for s in scans for doc in s["undecodable_shown"]][:MALFORMED_SHOWN],
        "removed_by_filter": clean["removed"],
        "changed_by_filter": clean["changed"],
        "exact_duplicates": dedup["exact_duplicates"],
        "near_duplicates": dedup["near_duplicates"],
        "decontaminated": sum(e["contaminated"] for e in encodes),
        "contamination": contamination,
        "lsh": dedup["lsh"],
        "sources": sources,
        "tokenizer": tokenizer.describe(),
        "tokens_per_byte": (split_tokens["train"] + split_tokens["val"]) / max(1, source_bytes),
        "unigram_entropy_nats": unigram_entropy(counts) if counts.sum() else 0.0,
        "length_histogram": {"bins_tokens": LENGTH_BINS[:-1], "documents": histogram.tolist()},
        "removed_samples": "removed/<filter>.jsonl",
    }


def _write_removed(tmp: Path, scans: list[dict], dedup: dict, encodes: list[dict], limit: int) -> None:
    """A sample of what every filter removed, for inspection: removed/<filter>.jsonl."""
    samples = merge_stats([s["clean"] for s in scans])["samples"]
    samples.update(dedup["samples"])
    samples["decontaminated"] = [s for e in encodes for s in e["samples"]][:limit]
    (tmp / "removed").mkdir()
    for name, docs in samples.items():
        if docs:
            (tmp / "removed" / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))


def _publish(tmp: Path, out: Path) -> None:
    """Move the finished corpus into place; an old one is removed only after the new one is there."""
    if not out.exists():
        tmp.rename(out)
        return
    old = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.old-"))
    out.rename(old / out.name)
    tmp.rename(out)
    shutil.rmtree(old)


def _unused_note(stats: dict) -> str:
    """What of the inputs was left out, for an error that says too few documents remain."""
    note = ""
    if skipped := stats["skipped_files"]:
        note += f"; {plural(len(skipped), 'damaged input file was', 'damaged input files were')} skipped, the " \
                f"first {skipped[0]['path']}: {skipped[0]['reason']}"
    if stats["malformed"]:
        note += f"; {plural(stats['malformed'], 'malformed line or row was', 'malformed lines or rows were')} left " \
                f"out, the first {stats['malformed_lines'][0]}"
    return note


def _unused_lines(manifest: dict) -> list[str]:
    """A line per skipped input file (up to SKIPPED_SHOWN) and one for the malformed lines and rows, if any."""
    skipped, malformed = manifest.get("skipped_files", []), manifest.get("malformed", {})
    lines = [f"skipped       {s['path']}: {s['reason']}" for s in skipped[:SKIPPED_SHOWN]]
    if len(skipped) > SKIPPED_SHOWN:
        lines.append(f"skipped       ... {len(skipped) - SKIPPED_SHOWN} more damaged files (`keel data stats` lists "
                     f"all)")
    if malformed.get("records"):
        lines.append(f"malformed     {plural(malformed['records'], 'line or row', 'lines or rows')} in "
                     f"{plural(malformed['files'], 'file', 'files')}, left out (`keel data stats` names them)")
    return lines


def describe(manifest: dict) -> str:
    s, docs, toks = manifest["stats"], manifest["documents"], manifest["tokens"]
    return "\n".join([
        f"corpus        {manifest['fingerprint'][:16]}  ({manifest['tokenizer']['name']} tokenizer, "
        f"vocab {manifest['tokenizer']['vocab_size']}, {manifest['dtype']})",
        f"sources       {', '.join(manifest['sources'])}: {manifest['source_files']} files, "
        f"{manifest['source_bytes'] / 1e6:.1f} MB",
        f"documents     {docs['train']:,} train, {docs['val']:,} validation",
        f"tokens        {toks['train']:,} train, {toks['val']:,} validation "
        f"({s['tokens_per_byte']:.3f} tokens/byte)",
        f"unigram entropy {s['unigram_entropy_nats']:.3f} nats/token (the loss of a model that learns only "
        f"token frequencies)",
        *_unused_lines(manifest),
    ])
