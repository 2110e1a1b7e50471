"""`keel data prepare`: sources → documents → tokens → shards + manifest.json.

The output directory appears complete or not at all: everything is written into `<dir>.tmp` and
renamed into place last.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import shutil
import sysconfig
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from keel.data.shards import FORMAT_VERSION, MANIFEST, read_manifest, sha256_file, token_dtype
from keel.data.tokenizer import ByteTokenizer, get_tokenizer
from keel.errors import DataError

BUILTIN_STDLIB = "stdlib"
TEXT_SUFFIXES = (".txt", ".py", ".md")
SUFFIXES = TEXT_SUFFIXES + (".jsonl",)
SHARD_TOKENS = 1 << 28  # 512 MiB of uint16 per shard


def stdlib_files() -> list[Path]:
    """The running interpreter's standard library sources, without site-packages."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py")
                  if not {"site-packages", "dist-packages", "__pycache__"} & set(p.relative_to(root).parts))


def source_files(sources: list[str]) -> list[Path]:
    files: list[Path] = []
    for source in sources:
        if source == BUILTIN_STDLIB:
            files += stdlib_files()
            continue
        path = Path(source)
        if path.is_dir():
            files += sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in SUFFIXES)
        elif path.is_file():
            if path.suffix not in SUFFIXES:
                raise DataError(f"source {source!r} has an unsupported type; expected {', '.join(SUFFIXES)} files, "
                                f"a directory of them, or '{BUILTIN_STDLIB}'")
            files.append(path)
        else:
            raise DataError(f"source {source!r} does not exist; give files, directories or '{BUILTIN_STDLIB}'")
    if not files:
        raise DataError(f"sources {sources} hold no {', '.join(SUFFIXES)} files")
    return files


def documents(path: Path) -> Iterator[bytes]:
    """One document per text file; one per line (its `text` field) of a .jsonl file."""
    if path.suffix != ".jsonl":
        yield path.read_bytes()
        return
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                text = json.loads(line)["text"]
                if not isinstance(text, str):
                    raise TypeError("text is not a string")
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise DataError(f"{path}:{lineno}: expected a JSON object with a string 'text' field ({e})") from None
            yield text.encode("utf-8")


def is_validation(doc: bytes, val_fraction: float) -> bool:
    """Deterministic hold-out by document content: the same document always lands in the same split."""
    bucket = int.from_bytes(hashlib.sha256(doc).digest()[:8], "little") % 1_000_000
    return bucket < val_fraction * 1_000_000


@dataclass
class _SplitWriter:
    directory: Path
    split: str
    dtype: np.dtype
    files: list[dict] = field(default_factory=list)
    documents: int = 0
    pending: list[np.ndarray] = field(default_factory=list)
    pending_tokens: int = 0
    counts: np.ndarray | None = None

    def add(self, tokens: np.ndarray) -> None:
        self.documents += 1
        self.pending.append(tokens)
        self.pending_tokens += len(tokens)
        if self.pending_tokens >= SHARD_TOKENS:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        data = np.concatenate(self.pending).astype(self.dtype)
        counts = np.bincount(data, minlength=1)
        self.counts = counts if self.counts is None else _add_counts(self.counts, counts)
        name = f"{self.split}-{len(self.files):05d}.bin"
        data.tofile(self.directory / name)
        self.files.append({"name": name, "split": self.split, "tokens": int(len(data)),
                           "sha256": sha256_file(self.directory / name)})
        self.pending, self.pending_tokens = [], 0

    @property
    def tokens(self) -> int:
        return sum(f["tokens"] for f in self.files)


def _add_counts(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    out = np.zeros(max(len(a), len(b)), dtype=np.int64)
    out[: len(a)] += a
    out[: len(b)] += b
    return out


def unigram_entropy(counts: np.ndarray) -> float:
    """Entropy in nats of the token frequencies: the loss of a model that learns only frequencies."""
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def source_fingerprint(files: list[Path]) -> str:
    h = hashlib.sha256()
    for path in files:
        h.update(f"{path.name}\0{sha256_file(path)}\0".encode())
    return h.hexdigest()


def prepare(sources: list[str], out: str | Path, tokenizer_name: str = "byte", val_fraction: float = 0.01,
            force: bool = False) -> dict:
    """Build the corpus at `out` and return its manifest. An existing corpus built from the same
    sources is kept as it is; a different one is replaced only with `force`. Concurrent calls for
    the same `out` (every worker of a job started by an external launcher) prepare it once."""
    out = Path(out)
    tokenizer = get_tokenizer(tokenizer_name)
    files = source_files(sources)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _prepare_locked(files, sources, out, tokenizer, val_fraction, force)


def _prepare_locked(files: list[Path], sources: list[str], out: Path, tokenizer: ByteTokenizer,
                    val_fraction: float, force: bool) -> dict:
    started = time.time()
    fingerprint_of_sources = source_fingerprint(files)
    if (out / MANIFEST).exists():
        existing = read_manifest(out)
        same = (existing.get("source_fingerprint") == fingerprint_of_sources
                and existing.get("tokenizer", {}).get("name") == tokenizer.name
                and existing.get("val_fraction") == val_fraction)
        if same and not force:
            return existing
        if not force:
            raise DataError(f"{str(out)!r} already holds a corpus prepared from other sources or settings; "
                            f"choose another --out or pass --force to replace it")
    elif out.exists() and any(out.iterdir()):
        raise DataError(f"{str(out)!r} exists and is not a prepared corpus; choose an empty or new --out directory")

    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    try:
        manifest = _write_corpus(tmp, files, sources, tokenizer, val_fraction, fingerprint_of_sources, started)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _publish(tmp, out)
    return manifest


def _write_corpus(tmp: Path, files: list[Path], sources: list[str], tokenizer: ByteTokenizer, val_fraction: float,
                  fingerprint_of_sources: str, started: float) -> dict:
    dtype = token_dtype(tokenizer.vocab_size)
    writers = {s: _SplitWriter(tmp, s, dtype) for s in ("train", "val")}
    source_bytes = 0
    for path in files:
        for doc in documents(path):
            source_bytes += len(doc)
            writers["val" if is_validation(doc, val_fraction) else "train"].add(tokenizer.encode_document(doc))
    for writer in writers.values():
        writer.flush()
    if not writers["train"].files or not writers["val"].files:
        raise DataError(f"sources {sources} give {writers['train'].documents} training and {writers['val'].documents} "
                        f"validation documents; both splits need at least one (more documents or another "
                        f"data.val_fraction)")
    shard_files = writers["train"].files + writers["val"].files
    fingerprint = hashlib.sha256(json.dumps([tokenizer.describe(), [f["sha256"] for f in shard_files]])
                                 .encode()).hexdigest()
    train_tokens = writers["train"].tokens
    manifest = {
        "format_version": FORMAT_VERSION,
        "sources": sources,
        "source_files": len(files),
        "source_bytes": source_bytes,
        "source_fingerprint": fingerprint_of_sources,
        "tokenizer": tokenizer.describe(),
        "dtype": dtype.name,
        "val_fraction": val_fraction,
        "documents": {s: w.documents for s, w in writers.items()},
        "tokens": {s: w.tokens for s, w in writers.items()},
        "files": shard_files,
        "fingerprint": fingerprint,
        "stats": {
            "unigram_entropy_nats": unigram_entropy(writers["train"].counts),
            "tokens_per_byte": (train_tokens + writers["val"].tokens) / max(1, source_bytes),
            "prepare_seconds": round(time.time() - started, 3),
        },
    }
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def _publish(tmp: Path, out: Path) -> None:
    """Move the finished corpus into place; an old one is removed only after the new one is there."""
    if not out.exists():
        tmp.rename(out)
        return
    old = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.old-"))
    out.rename(old / out.name)
    tmp.rename(out)
    shutil.rmtree(old)


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
    ])
