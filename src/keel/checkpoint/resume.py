"""The checks a start makes on the checkpoints it will resume, before any worker runs: torch-free, so
that the launcher imports neither DCP nor DTensor to make them."""

from __future__ import annotations

from pathlib import Path

from keel.checkpoint.identity import check_continuation
from keel.checkpoint.manifest import MANIFEST, committed, read_manifest, verify
from keel.checkpoint.storage import Storage, locate
from keel.config import Config
from keel.errors import CheckpointError


def checkpoint_root(cfg: Config, run_dir: Path) -> Storage:
    return Storage(cfg.checkpoint.dir or run_dir / "checkpoints")


def check_resume(storage: Storage, resume: str) -> None:
    """What a start can check before any worker runs: `never` must not overwrite a checkpoint that
    verifies, and an explicit path must be a committed checkpoint."""
    if resume == "auto":
        return
    if resume == "never":
        for name in committed(storage)[::-1]:
            if not verify(storage, name):
                raise CheckpointError(f"--resume never: {storage} already holds checkpoints (latest verified: "
                                      f"{name}) that a fresh run would overwrite; use another --run-dir")
        return
    if read_manifest(*locate(resume)) is None:
        raise CheckpointError(f"--resume {resume!r} is not a committed keel checkpoint (a directory holding "
                              f"{MANIFEST}); pass a checkpoints/step-NNNNNN directory, auto or never")


def check_resume_identity(storage: Storage, resume: str, cfg: Config, identity: dict,
                          accepted: tuple[str, ...]) -> None:
    """Refuse, before any worker starts (and so before anything is written), a resume that would change the
    run's identity, or a finished run given settings it did not compute with: compared with the checkpoint
    the workers will load (the newest whose files are all there, for `auto`)."""
    if resume == "never":
        return
    if resume == "auto":
        names = [n for n in committed(storage)[::-1] if not verify(storage, n, checksums=False)][:1]
    else:
        storage, name = locate(resume)
        names = [name]
    for name in names:
        manifest = read_manifest(storage, name)
        if manifest is not None and "unreadable" not in manifest:
            check_continuation(manifest, cfg, identity, accepted, storage.path(name))
