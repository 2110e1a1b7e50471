"""Inputs that are not local files: fsspec URLs (`s3://bucket/prefix/*.parquet`, `gs://`, `https://`, ...) and
Hugging Face datasets (`hf:NAME[:CONFIG][@SPLIT]`).

Each is fetched once into a local cache beside the corpus (OUT's parent, `.OUT.sources/`), and from there on
it is a local file like any other: the preparation reads it with the same readers, checks it with the
same checksums, counts it in its source's statistics and resumes over it. An entry of the cache is
complete or absent (written under a temporary name, then renamed), and it is named after what identifies
its content, so that the next preparation reuses it and never an outdated one:
- a remote object: its URL with its ETag (or modification time) and size;
- a local dataset (a `save_to_disk` directory, a directory of data files `load_dataset` reads, or one data
  file): the fingerprint `datasets` computes of its Arrow table;
- a dataset of the Hub: its commit, streamed (`streaming=True`: no Arrow copy in the datasets cache) into
  one JSON Lines file of its `data.text_field`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

from keel.errors import DataError

HF_PREFIX = "hf:"
DATA_FILE_BUILDERS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".csv": "csv", ".txt": "text"}
_GLOB_CHARS = re.compile(r"[*?\[]")
# `hf:NAME[:CONFIG][@SPLIT]`: NAME may be a path (with `/`), CONFIG and SPLIT are names.
_HF_SPEC = re.compile(r"hf:(?P<name>[^:@]+)(?::(?P<config>[\w.\-]+))?(?:@(?P<split>[\w.\-\[\]:%]+))?")


def is_remote(entry: str) -> bool:
    """Whether a source's path entry is fetched here: a Hugging Face dataset or a URL (not file://)."""
    return entry.startswith(HF_PREFIX) or ("://" in entry and not entry.startswith("file://"))


def fetch(source: str, entry: str, cache: Path, text_field: str, is_readable: Any) -> list[Path]:
    """The local files of one remote path entry of `source`, fetched into `cache` where not there yet.
    `is_readable(path)` says whether keel reads a file of that name (its type)."""
    where = f"source {source!r}: path {entry!r}"
    if entry.startswith(HF_PREFIX):
        return [_hf_dataset(where, entry, cache, text_field)]
    return _objects(where, entry, cache, is_readable)


def _slug(text: str) -> str:
    return re.sub(r"[^\w.\-]+", "_", text).strip("_")[-60:]


def _complete(path: Path, write: Any) -> Path:
    """`path`, written by `write(tmp)` unless a complete copy is there; the rename makes it whole or absent."""
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


# ---------------------------------------------------------------- fsspec URLs


def _objects(where: str, url: str, cache: Path, is_readable: Any) -> list[Path]:
    try:
        import fsspec

        fs, path = fsspec.core.url_to_fs(url)
    except ImportError as e:  # the protocol's package: s3fs, gcsfs, ...
        raise DataError(f"{where}: reading it needs {e.name or 'its fsspec package'}; pip install "
                        f"'keel-pretrain[s3]' for s3:// (or the fsspec package of its protocol)") from None
    except ValueError as e:
        raise DataError(f"{where}: not a URL fsspec can read ({e})") from None
    fs.invalidate_cache()  # fsspec keeps listings (versions among them) for the life of the process
    try:
        if _GLOB_CHARS.search(path):
            names = [p for p in fs.glob(path) if fs.isfile(p)]
        elif fs.isdir(path):
            names = list(fs.find(path))
        else:
            names = [path] if fs.exists(path) else []
    except (OSError, PermissionError) as e:
        raise DataError(f"{where} cannot be listed ({type(e).__name__}: {e})") from None
    names = sorted(p for p in names if is_readable(Path(p)) and not Path(p).name.startswith("."))
    if not names:
        raise DataError(f"{where} holds no files keel reads (or does not exist); give objects, prefixes or globs "
                        f"of .txt, .md, .py, .jsonl, .jsonl.gz, .jsonl.zst or .parquet files")
    return [_object(where, fs, name, cache) for name in names]


def _object(where: str, fs: Any, name: str, cache: Path) -> Path:
    """One object, fetched into the cache under a name made of its URL, version and size (its type kept)."""
    try:
        info = fs.info(name)
    except OSError as e:
        raise DataError(f"{where}: {name} cannot be read ({type(e).__name__}: {e})") from None
    version = info.get("ETag") or info.get("etag") or info.get("LastModified") or info.get("mtime") or ""
    key = hashlib.sha256(json.dumps([fs.unstrip_protocol(name), str(version), info.get("size")]).encode())
    local = cache / f"url-{key.hexdigest()[:16]}" / Path(name).name

    def download(tmp: Path) -> None:
        try:
            fs.get_file(name, str(tmp))
        except OSError as e:
            raise DataError(f"{where}: {name} could not be fetched ({type(e).__name__}: {e})") from None

    return _complete(local, download)


# ---------------------------------------------------------------- Hugging Face datasets


def parse_hf(entry: str) -> tuple[str, str | None, str]:
    """`hf:NAME[:CONFIG][@SPLIT]` → (NAME, CONFIG or None, SPLIT, `train` unless given)."""
    match = _HF_SPEC.fullmatch(entry)
    if match is None:
        raise DataError(f"path {entry!r}: expected hf:NAME[:CONFIG][@SPLIT], e.g. hf:allenai/c4:en@train or "
                        f"hf:/data/my_dataset@validation")
    return match["name"], match["config"], match["split"] or "train"


def _hf_dataset(where: str, entry: str, cache: Path, text_field: str) -> Path:
    """The dataset's `text_field`, one JSON line per row, in the cache."""
    name, config, split = parse_hf(entry)
    try:
        import datasets
    except ImportError:
        raise DataError(f"{where}: reading Hugging Face datasets needs the datasets package; pip install "
                        f"'keel-pretrain[hf]'") from None
    datasets.disable_progress_bars()
    local = Path(name).expanduser()
    try:
        rows, identity = _hf_rows(where, datasets, local, name, config, split)
    except DataError:
        raise
    except Exception as e:  # datasets' own errors (no such dataset, config or split; unreachable Hub)
        first = (str(e).strip().splitlines() or [""])[0][:300]
        raise DataError(f"{where} cannot be loaded ({type(e).__name__}: {first})") from None
    columns = list(getattr(rows, "column_names", None) or [])
    if columns and text_field not in columns:
        raise DataError(f"{where}: no column {text_field!r} (columns: {', '.join(columns[:10])}); set "
                        f"data.text_field to the column that holds the text")
    key = hashlib.sha256(json.dumps([entry, identity, text_field]).encode()).hexdigest()[:16]
    target = cache / f"hf-{_slug(name)}-{key}" / f"{_slug(split)}.jsonl"

    def write(tmp: Path) -> None:
        with open(tmp, "w", encoding="utf-8") as out:
            for row in rows:
                text = row.get(text_field)
                out.write(json.dumps({text_field: text if isinstance(text, str) else None}) + "\n")

    return _complete(target, write)


def _hf_rows(where: str, datasets: Any, local: Path, name: str, config: str | None, split: str
             ) -> tuple[Any, str]:
    """The rows of the split and what identifies their content: a local dataset's fingerprint, a Hub
    dataset's commit (streamed)."""
    if local.is_dir() and any((local / f).exists() for f in ("state.json", "dataset_dict.json")):
        loaded = datasets.load_from_disk(str(local))  # a save_to_disk directory
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise DataError(f"{where}: no split {split!r} (splits: {', '.join(loaded)})")
            loaded = loaded[split]
        return loaded, loaded._fingerprint
    if local.is_file():  # one data file, read by the builder of its type
        builder = DATA_FILE_BUILDERS.get("".join(local.suffixes[-1:]))
        if builder is None:
            raise DataError(f"{where}: a data file must end in {', '.join(DATA_FILE_BUILDERS)}")
        loaded = datasets.load_dataset(builder, data_files=str(local), split=split)
        return loaded, loaded._fingerprint
    if local.exists():  # a directory of data files (Parquet, JSON Lines, CSV, ...) that load_dataset reads
        loaded = datasets.load_dataset(str(local), config, split=split)
        return loaded, loaded._fingerprint
    from huggingface_hub import HfApi

    commit = HfApi().dataset_info(name).sha
    return datasets.load_dataset(name, config, split=split, streaming=True, revision=commit), str(commit)
