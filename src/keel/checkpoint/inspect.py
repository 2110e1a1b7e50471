"""Checkpoints seen from outside a run: find them, list them, verify them, read them whole.
Nothing here needs a process group."""

from __future__ import annotations

import hashlib
import json
import tempfile
import time
import tomllib
from pathlib import Path

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from keel.checkpoint.manifest import (
    MANIFEST,
    checkpoints,
    is_set_aside,
    read_manifest,
    step_of,
    uncommitted,
    verify,
)
from keel.checkpoint.storage import Storage, locate, size_text
from keel.errors import CheckpointError


def find_checkpoints(path: str | Path) -> tuple[Storage, list[str]]:
    """What PATH names: one checkpoint (`…/step-NNNNNN`), a checkpoint root, or a run directory (whose
    config.toml may place its checkpoints elsewhere, e.g. on S3). Returns the root and the names."""
    text = str(path)
    storage, name = locate(text)
    if step_of(name) is not None and storage.exists(name):
        return storage, [name]
    run_config = Path(text) / "config.toml"
    root: str | Path = text
    if "://" not in text and run_config.is_file():
        configured = tomllib.loads(run_config.read_text()).get("checkpoint", {}).get("dir", "")
        root = configured or Path(text) / "checkpoints"
    storage = Storage(root)
    found = set(checkpoints(storage)) | set(uncommitted(storage)) | {n for n in storage.names() if is_set_aside(n)}
    names = sorted(found, key=lambda n: (step_of(n.split(".")[0]), n))
    if not names and not storage.names():
        raise CheckpointError(f"{text!r} holds no keel checkpoints; pass a run directory, its checkpoints "
                              f"directory or a checkpoints/step-NNNNNN directory")
    return storage, names


def verdict(name: str) -> str:
    """What a name that is not a checkpoint is ("" for a checkpoint)."""
    if is_set_aside(name):
        return "set aside (did not verify; never resumed or removed)"
    return "" if step_of(name) is not None else "unfinished save, not a checkpoint (ignored on resume)"


def latest_verified(path: str | Path) -> tuple[Storage, str]:
    """The newest checkpoint under PATH that verifies."""
    storage, names = find_checkpoints(path)
    for name in reversed(names):
        if step_of(name) is not None and not verify(storage, name):
            return storage, name
    raise CheckpointError(f"no checkpoint under {str(path)!r} verifies; see `keel ckpt verify {path}`")


def _age(seconds: float) -> str:
    for unit, span in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= span:
            return f"{seconds / span:.1f} {unit}"
    return f"{seconds:.0f} s"


def list_rows(storage: Storage, names: list[str], checksums: bool = False) -> list[dict]:
    """One row per checkpoint for `keel ckpt ls`."""
    latest = storage.latest()
    rows = []
    for name in names:
        manifest = read_manifest(storage, name)
        problems = [] if verdict(name) else verify(storage, name, checksums=checksums)
        state = verdict(name) or (("verified" if checksums else "complete") if not problems else
                                           "CORRUPT: " + problems[0])
        step = step_of(name.split(".")[0])
        rows.append({"name": name, "step": step,
                     "size": sum(storage.files(name).values()),
                     "age_s": time.time() - manifest["time"] if manifest and "time" in manifest else None,
                     "state": state, "latest": name == latest,
                     "permanent": bool(manifest and manifest.get("permanent"))})
    return rows


def format_rows(rows: list[dict]) -> list[str]:
    lines = [f"{'checkpoint':<22} {'step':>8} {'size':>10} {'age':>9}  state"]
    for r in rows:
        marks = "".join([" (latest)" if r["latest"] else "", " (permanent)" if r["permanent"] else ""])
        age = _age(r["age_s"]) if r["age_s"] is not None else "-"
        lines.append(f"{r['name']:<22} {r['step']:>8} {size_text(r['size']):>10} {age:>9}  {r['state']}{marks}")
    return lines


def load_full_state(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint, whole and keyed by flat name (`model.…`, `optim.state.…`), whatever
    layout saved it. Meant for inspection and tests."""
    if read_manifest(*locate(path)) is None:
        raise CheckpointError(f"{str(path)!r} is not a committed keel checkpoint (no {MANIFEST})")
    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(path, Path(tmp) / "state.pt")
        nested = torch.load(Path(tmp) / "state.pt", weights_only=False)
    flat: dict[str, torch.Tensor] = {}

    def walk(prefix: str, value: object) -> None:
        if isinstance(value, torch.Tensor):
            flat[prefix] = value
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)

    walk("", nested)
    return flat


def state_digests(path: Path) -> dict[str, str]:
    """sha256 of every model and optimizer tensor of a checkpoint, keyed by name."""
    return {name: hashlib.sha256(t.detach().contiguous().cpu().numpy().tobytes()).hexdigest()
            for name, t in load_full_state(path).items()}


def state_sha256(path: Path) -> str:
    """One digest of all model and optimizer tensors: equal iff the states are bitwise equal."""
    return hashlib.sha256(json.dumps(sorted(state_digests(path).items())).encode()).hexdigest()
