"""Heartbeats, and the launcher's watch over them: hangs of a worker that cannot run Python at all.

Under `keel train`, each worker's watchdog thread writes, every `poll_s`, where its rank is and how
long that beat holds (its section's timeout) to a file in a directory of its node that the node's
launcher chose (KEEL_HEARTBEATS). A worker whose beat has expired while its process still runs is
frozen: stopped (SIGSTOP), stuck in the kernel, or holding the GIL. It can take no part in finding
its own hang, and if it is rank 0 neither can the process group's store it hosts, so the decision is
the launcher's, which no fault of its workers can stop: it names the frozen ranks in a `hang` event,
has its node's other workers write their stacks (SIGUSR2, answered by faulthandler in C, even by a
worker blocked in a call) and kills its workers, which it then restarts from the latest checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from keel.rundir.events import EventLog

ENV = "KEEL_HEARTBEATS"
STACKS_SIGNAL = signal.SIGUSR2  # a worker's watchdog has faulthandler answer it with every thread's stack
DUMP_WAIT_S = 3.0  # how long the launcher waits for the others' stacks before it kills them
EXIT_WAIT_S = 10.0
PROCESS_STATES = {"T": "stopped", "t": "stopped by a tracer", "D": "in uninterruptible sleep",
                  "R": "running", "S": "sleeping"}  # /proc/PID/stat; R or S without beats: holding the GIL


def heartbeat_dir() -> Path | None:
    """Where this worker beats, when a launcher watches it."""
    return Path(os.environ[ENV]) if os.environ.get(ENV) else None


def beat_path(directory: Path, rank: int) -> Path:
    return directory / f"rank-{rank}.json"


def beat(directory: Path, rank: int, record: dict, valid_s: float) -> None:
    """Atomically: the launcher never reads half a beat."""
    tmp = directory / f".rank-{rank}.{threading.get_native_id()}.json.tmp"  # the loop and the watchdog both beat
    tmp.write_text(json.dumps({**record, "pid": os.getpid(), "time": time.time(), "valid_s": valid_s}))
    os.replace(tmp, beat_path(directory, rank))


def read_beat(directory: Path, rank: int) -> dict | None:
    try:
        return json.loads(beat_path(directory, rank).read_text())
    except (OSError, ValueError):
        return None


def process_state(pid: int) -> str | None:
    """The kernel's one-letter state of `pid`, None once it has gone (a zombie has gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return None
    return None if state in ("Z", "X") else state


class HeartbeatWatch:
    """The launcher's side: one node's workers, by global rank and pid."""

    def __init__(self, run_dir: Path, say: Callable[[str], None] = print) -> None:
        self.run_dir, self.say = run_dir, say
        self.directory = Path(tempfile.mkdtemp(prefix="keel-heartbeats-"))
        os.environ[ENV] = str(self.directory)  # the workers it starts inherit it

    def frozen(self, workers: dict[int, int]) -> dict[int, dict]:
        """The ranks whose process runs but whose last beat has expired, with that beat."""
        now, found = time.time(), {}
        for rank, pid in workers.items():
            last = read_beat(self.directory, rank)
            if (last is not None and last["pid"] == pid and now - last["time"] > last["valid_s"]
                    and process_state(pid) is not None):
                found[rank] = last
        return found

    def end_frozen(self, workers: dict[int, int], restarting: bool) -> bool:
        """If a worker is frozen: report it, have the others write their stacks, kill all. Whether it did."""
        frozen = self.frozen(workers)
        if not frozen:
            return False
        now = time.time()
        where = {rank: b["where"] for rank in workers if (b := read_beat(self.directory, rank)) is not None}
        states = {rank: PROCESS_STATES.get(s := process_state(pid) or "gone", s) for rank, pid in workers.items()}
        first = frozen[min(frozen)]
        silent = {rank: round(now - b["time"], 1) for rank, b in frozen.items()}
        reason = "; ".join(f"rank {r} (pid {workers[r]}, {states[r]}) sent no heartbeat for {s} s, past its "
                           f"{frozen[r]['valid_s']:.0f} s {frozen[r]['where']['section']} timeout"
                           for r, s in silent.items())
        others = {rank: pid for rank, pid in workers.items() if rank not in frozen}
        self._dump_stacks(others, f"rank(s) {', '.join(map(str, frozen))} frozen")
        events = EventLog(self.run_dir / "events.jsonl", rank=-1)  # -1: this node's launcher
        step = max(w["step"] for w in where.values())  # a beat may predate its rank's last step
        events.emit("hang", step, "restart" if restarting else "stop",
                    stuck_ranks=sorted(frozen), hosts=[frozen[r]["host"] for r in sorted(frozen)],
                    section=first["where"]["section"], reason=reason, detected_by="launcher", silent_s=silent,
                    process_states={r: states[r] for r in workers}, where=where, timeouts=first["timeouts"],
                    stacks=str(self.run_dir / "logs" / "stacks-rank-*.txt"))
        events.close()
        self.say(f"keel: hang: {reason}; stacks of rank(s) {', '.join(map(str, others)) or 'none'} in "
                 f"{self.run_dir / 'logs'}; ending the workers"
                 + (" to restart them from the latest checkpoint" if restarting else ""))
        # A stopped worker takes no SIGTERM, and the others may be blocked on it: nothing is saved on a
        # hang (the restart resumes from the latest checkpoint), so all go at once.
        for pid in workers.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + EXIT_WAIT_S
        while any(process_state(pid) is not None for pid in workers.values()) and time.monotonic() < deadline:
            time.sleep(0.05)
        return True

    def _dump_stacks(self, workers: dict[int, int], why: str) -> None:
        logs = self.run_dir / "logs"
        sizes = {}
        for rank, pid in workers.items():
            path = logs / f"stacks-rank-{rank}.txt"
            with contextlib.suppress(OSError), open(path, "a") as f:
                f.write(f"\n=== rank {rank}: stacks asked by the launcher at {time.strftime('%Y-%m-%d %H:%M:%S')}: "
                        f"{why}\n")
            with contextlib.suppress(OSError):
                sizes[rank] = path.stat().st_size
                os.kill(pid, STACKS_SIGNAL)
        deadline = time.monotonic() + DUMP_WAIT_S
        while sizes and time.monotonic() < deadline:
            sizes = {r: s for r, s in sizes.items() if _size(logs / f"stacks-rank-{r}.txt") <= s}
            time.sleep(0.1)
        time.sleep(0.2)  # a dump grows the file thread by thread: let the last threads' lines follow

    def close(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)
        os.environ.pop(ENV, None)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0
