"""Fault injectors: callbacks that deliver a real fault to a real process at a chosen point."""

from __future__ import annotations

import errno
import os
import signal
from pathlib import Path
from typing import Any

import torch.distributed as dist

from keel.callbacks import Callback
from keel.checkpoint.manifest import step_name


class SigkillAfterCheckpoint(Callback):
    """SIGKILL this process, if it is `rank`, once the checkpoint of `step` is committed."""

    def __init__(self, step: int, rank: int = 1) -> None:
        self.step, self.rank = step, rank

    def on_checkpoint_saved(self, state: Any, path: str) -> None:
        if path.rstrip("/").endswith(step_name(self.step)) and dist.get_rank() == self.rank:
            os.kill(os.getpid(), signal.SIGKILL)


class SigkillDuringCheckpointWrite(Callback):
    """SIGKILL this process, if it is `rank`, in the middle of the background write of `step`'s
    checkpoint: its files are on disk, the commit has not happened."""

    def __init__(self, step: int, rank: int = 1) -> None:
        self.step, self.rank = step, rank

    def on_checkpoint_write(self, step: int, staging_path: str) -> None:
        if step == self.step and dist.get_rank() == self.rank:
            os.kill(os.getpid(), signal.SIGKILL)


class FillDiskBeforeCheckpoint(Callback):
    """Fill the volume under `path` with a file before the save of `step`, so that the save meets a
    real ENOSPC; the file is removed once that save has failed, so the next save can succeed."""

    def __init__(self, path: str, step: int) -> None:
        self.filler, self.step = Path(path) / "filler", step

    def on_step_end(self, state: Any, report: dict) -> None:
        if state.step == self.step - 1 and dist.get_rank() == 0:
            with open(self.filler, "wb") as f:
                block = b"\0" * (1 << 20)
                try:
                    while True:
                        f.write(block)
                        f.flush()
                except OSError as e:
                    if e.errno != errno.ENOSPC:
                        raise

    def on_checkpoint_failed(self, state: Any, step: int, error: str) -> None:
        if step == self.step and dist.get_rank() == 0:
            self.filler.unlink(missing_ok=True)
