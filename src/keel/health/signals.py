"""Pause and preemption: SIGTERM or SIGUSR1 to any worker (or to the launcher, which passes SIGTERM on
to its workers), or `keel pause RUN_DIR`, asks the run to stop at the next step boundary.

A request only sets a flag here. The flag travels in the step report's all-reduce, so every rank
learns of it at the same step, writes the same synchronous checkpoint and exits 75 together.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

PAUSE_FILE = "PAUSE"  # `keel pause` writes it; the run consumes it when it pauses
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
_early: list[str] = []  # stop signals received before the training loop listened


@contextlib.contextmanager
def stop_signals_kept() -> Iterator[None]:
    """Around `keel train`, from its first statements: a stop signal that arrives while the process is still
    starting (imports, validation, rendezvous, loading) is kept for the loop instead of killing the process,
    so a pause asked for at any moment ends in a pause. The handlers are put back afterwards."""
    main = threading.current_thread() is threading.main_thread()  # signal handlers live in the main thread
    previous = {sig: signal.signal(sig, _keep) for sig in SIGNALS} if main else {}
    if main:  # a worker's worker server blocked them until now: one sent since the fork is kept here
        signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _early.clear()


def _keep(signum: int, frame: FrameType | None) -> None:
    _early.append(signal.Signals(signum).name)


def stop_requested_early() -> str:
    """The first stop signal kept by `stop_signals_kept` (empty: none)."""
    return _early[0] if _early else ""


def request_pause(run_dir: Path, reason: str = "keel pause") -> Path:
    """The control file that asks a running job to pause."""
    path = run_dir / PAUSE_FILE
    path.write_text(json.dumps({"reason": reason, "host": socket.gethostname(), "pid": os.getpid(),
                                "time": time.time()}) + "\n")
    return path


class StopRequests:
    """Signals received by this process, and (on rank 0) the run directory's control file."""

    def __init__(self, run_dir: Path, rank: int) -> None:
        self.control = run_dir / PAUSE_FILE if rank == 0 else None
        self.received: str = stop_requested_early()
        self._previous: dict[int, object] = {}
        if threading.current_thread() is threading.main_thread():  # signal handlers live in the main thread
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = signal.Signals(signum).name

    def pending(self) -> bool:
        return bool(self.received) or (self.control is not None and self.control.exists())

    def reason(self) -> str:
        if self.received:
            return self.received
        if self.control is not None and self.control.exists():
            try:
                return json.loads(self.control.read_text()).get("reason", "keel pause")
            except (OSError, ValueError):
                return "keel pause"
        return ""

    def consume(self) -> None:
        """The pause is done: the rerun must not pause again at its first step."""
        if self.control is not None:
            self.control.unlink(missing_ok=True)

    def close(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)  # type: ignore[arg-type]
        self._previous.clear()
