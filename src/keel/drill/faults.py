"""Fault injectors: callbacks that deliver a real fault to a real process at a chosen point."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import torch.distributed as dist

from keel.callbacks import Callback


class SigkillAfterCheckpoint(Callback):
    """SIGKILL this process, if it is `rank`, right after the checkpoint of `step` is committed."""

    def __init__(self, step: int, rank: int = 1) -> None:
        self.step, self.rank = step, rank

    def on_checkpoint_saved(self, state: Any, path: Path) -> None:
        if state.step == self.step and dist.get_rank() == self.rank:
            os.kill(os.getpid(), signal.SIGKILL)
