"""Heartbeats, and the launcher's watch over them: hangs of a worker that cannot run Python at all.

Under `keel train`, each worker's watchdog thread writes, every `poll_s`, where its rank is and how
long that beat holds (its section's timeout) to a file in a directory of its node that the node's
launcher chose (KEEL_HEARTBEATS); once a rank handles a hang (a collective of its timed out, or an
alarm reached it), its beats say so. A worker whose beat has expired while its process still runs is
frozen: stopped (SIGSTOP), stuck in the kernel, or holding the GIL. It can take no part in finding
its own hang, and if it is rank 0 neither can the process group's store it hosts, so the decision is
the launcher's, which no fault of its workers can stop. It acts on a frozen worker, on a stopped one
while a peer waits on a hang, and on a reporter that could not name the ranks it waits for: it names
the ranks that stopped making progress (never one that waits for them: see `culprits`) in a `hang`
event, has its node's other workers write their stacks (SIGUSR2, answered by faulthandler in C, even
by a worker blocked in a call or holding the GIL) and kills its workers, which it then restarts from
the latest checkpoint.
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
from dataclasses import dataclass
from pathlib import Path

from keel.core.net import links_down
from keel.errors import EXIT_HANG
from keel.rundir.events import EventLog
from keel.rundir.quarantine import node_name

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


STOPPED = ("T", "t")  # a stopped process: decisive, whatever its last beat says


@dataclass
class Sighting:
    """What the launcher sees of its node's workers at one moment: by global rank, each one's pid, last beat
    (its own, not a previous worker's), kernel state (None once gone) and exit code (None while it runs)."""

    pids: dict[int, int]
    beats: dict[int, dict]
    states: dict[int, str | None]
    exits: dict[int, int | None]
    now: float

    def expired(self, rank: int) -> bool:
        b = self.beats.get(rank)
        return b is not None and self.now - b["time"] > b["valid_s"] and self.states[rank] is not None

    def waiting(self) -> dict[int, dict]:
        """The ranks that handle a hang (a collective of theirs timed out, or an alarm reached them): what
        their beats say of it. They wait for a peer; they are not the hang."""
        return {r: b["hang"] for r, b in self.beats.items() if b.get("hang")}

    def named_by_a_worker(self) -> bool:
        return any(h.get("named") for h in self.waiting().values())

    def hang_seen(self) -> bool:
        """A frozen worker, a worker that exited on a hang, a reporter that left the naming to the launcher,
        or a stopped worker while another waits on a hang."""
        waiting = self.waiting()
        return (any(self.expired(r) for r in self.pids) or EXIT_HANG in self.exits.values()
                or any(h.get("named") is False for h in waiting.values())
                or bool(waiting and any(self.states[r] in STOPPED for r in self.pids)))


def culprits(seen: Sighting) -> dict[int, str]:
    """The ranks of this node that stopped making progress, each with why, in order of evidence: stopped
    processes; those killed by a signal; frozen ones (an expired beat, and not waiting on a peer: they
    cannot run Python); those the reporter's alarm did not reach; else the furthest behind of the ranks not
    waiting. Never a rank whose beats say it waits on a hang, unless all do (then none is named here)."""
    waiting = seen.waiting()

    def state(r: int) -> str:
        return PROCESS_STATES.get(s := seen.states[r] or "gone", s)

    def silence(r: int) -> str:
        b = seen.beats.get(r)
        if b is None:
            return "sent no heartbeat"
        past = (f", past its {b['valid_s']:.0f} s {b['where']['section']} timeout" if seen.expired(r) else
                f" ({b['where']['phase']} of step {b['where']['step']})")
        return f"sent no heartbeat for {seen.now - b['time']:.1f} s{past}"

    def who(r: int) -> str:
        return f"rank {r} (pid {seen.pids[r]}, {state(r)})"

    found = {r: f"{who(r)} {silence(r)}" for r in seen.pids if seen.states[r] in STOPPED}
    # A rank that waited on a hang may have been killed for it (by this launcher): that is no fault of its own.
    found = found or {r: f"rank {r} (pid {seen.pids[r]}) was killed by signal {-code}"
                      for r, code in seen.exits.items() if code is not None and code < 0 and r not in waiting}
    found = found or {r: f"{who(r)} {silence(r)}" for r in seen.pids if seen.expired(r) and r not in waiting}
    unanswered = {r: h["by"] for h in waiting.values() for r in h.get("silent", []) if r in seen.pids}
    found = found or {r: f"{who(r)} did not answer rank {by}'s alarm" for r, by in unanswered.items()
                      if r not in waiting and seen.states[r] is not None}
    if found or not waiting:
        return found
    live = {r: tuple(b["where"]["progress"]) for r, b in seen.beats.items() if r not in waiting}
    behind = min(live.values(), default=None)
    return {r: f"{who(r)} is furthest behind, in {seen.beats[r]['where']['phase']} of step {p[0]}"
            for r, p in live.items() if p == behind}


def cut_off(seen: Sighting) -> dict[int, tuple[str, str]]:
    """The ranks of other nodes that did not answer the alarm of this node's reporter, each with its host and
    why: the reporter reached every rank the job's store reaches, so a whole node silent is a node cut off from
    the store (a network fault), which no launcher of its own can report, or one that cannot run Python, which
    its launcher names as well. Empty unless this node's reporter left ranks of other nodes unnamed."""
    found = {}
    for rank, hang in seen.waiting().items():
        if hang.get("by") == rank and hang.get("named") is False:
            for r, host in zip(hang.get("silent", []), hang.get("silent_hosts", []), strict=False):
                if r not in seen.pids:
                    found[r] = (host, f"rank {r} on {host} did not answer rank {rank}'s alarm: cut off from the "
                                      f"job's store (a network fault), or unable to run Python")
    return found


class HeartbeatWatch:
    """The launcher's side: one node's workers, by global rank and pid."""

    def __init__(self, run_dir: Path, say: Callable[[str], None] = print) -> None:
        self.run_dir, self.say = run_dir, say
        self.directory = Path(tempfile.mkdtemp(prefix="keel-heartbeats-"))
        self.ended: set[int] = set()  # the workers' pids it killed on a hang
        os.environ[ENV] = str(self.directory)  # the workers it starts inherit it

    def sighting(self, workers: dict[int, int], exits: dict[int, int | None] | None = None) -> Sighting:
        beats = {r: b for r, pid in workers.items() if (b := read_beat(self.directory, r)) is not None
                 and b["pid"] == pid}
        return Sighting(workers, beats, {r: process_state(pid) for r, pid in workers.items()},
                        {r: (exits or {}).get(r) for r in workers}, time.time())

    def end_hang(self, workers: dict[int, int], restarting: bool, exits: dict[int, int | None] | None = None) -> bool:
        """If a hang shows on this node, and no worker named it: name the ranks that stopped making progress in
        a `hang` event, have the others write their stacks, and kill all. Whether it did. `exits`: the
        workers' exit codes, by global rank (None while one runs)."""
        if set(workers.values()) <= self.ended:
            return False  # handled: the agent has not seen them gone yet
        seen = self.sighting(workers, exits)
        if not seen.hang_seen() or seen.named_by_a_worker():
            return False  # nothing to do, or the workers named it in their own event and end on their own
        stuck = culprits(seen)
        waiting = seen.waiting()
        answering = {r: pid for r, pid in workers.items() if seen.states[r] not in (*STOPPED, None)}
        if stuck:
            self._dump_stacks(answering, f"rank(s) {', '.join(map(str, stuck))} stopped making progress")
            self._report(seen, stuck, restarting)
        elif cut := cut_off(seen):
            if down := links_down():  # the silence is this node's own doing: its link is dead, not theirs
                me = node_name()
                cut = {r: (me, f"rank {r} on {me} is cut off from the job: this node's link {', '.join(down)} is "
                               f"down (the ranks of other nodes did not answer rank {r}'s alarm)") for r in waiting}
            self._report(seen, {r: why for r, (_, why) in cut.items()}, restarting,
                         hosts={r: host for r, (host, _) in cut.items()})
        else:  # the ranks they wait for live on another node, whose launcher names them
            self.say(f"keel: hang: rank(s) {', '.join(map(str, sorted(waiting)))} waited on a hang found on "
                     f"another node; ending this node's workers")
        # A stopped worker takes no SIGTERM, and the others may be blocked on it: nothing is saved on a
        # hang (the restart resumes from the latest checkpoint), so all go at once.
        self.ended |= set(workers.values())
        for pid in workers.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + EXIT_WAIT_S
        while any(process_state(pid) is not None for pid in workers.values()) and time.monotonic() < deadline:
            time.sleep(0.05)
        return True

    def _report(self, seen: Sighting, stuck: dict[int, str], restarting: bool,
                hosts: dict[int, str] | None = None) -> None:
        hosts = hosts or {r: seen.beats[r]["host"] for r in stuck if r in seen.beats}
        where = {rank: b["where"] for rank, b in seen.beats.items()}
        waiting = seen.waiting()
        first = seen.beats.get(min(stuck)) or next(iter(seen.beats.values()), {})
        reason = "; ".join(stuck.values())
        if waiting:
            said = sorted({h["reason"] for h in waiting.values()})
            reason += f"; rank(s) {', '.join(map(str, sorted(waiting)))} waited for it ({'; '.join(said)})"
        states = {r: PROCESS_STATES.get(s := seen.states[r] or "gone", s) for r in seen.pids}
        events = EventLog(self.run_dir / "events.jsonl", rank=-1)  # -1: this node's launcher
        step = max((w["step"] for w in where.values()), default=0)  # a beat may predate its rank's last step
        events.emit("hang", step, "restart" if restarting else "stop",
                    stuck_ranks=sorted(stuck), hosts=[hosts[r] for r in sorted(stuck) if r in hosts],
                    section=first.get("where", {}).get("section", "unknown"), reason=reason, detected_by="launcher",
                    silent_s={r: round(seen.now - seen.beats[r]["time"], 1) for r in stuck if r in seen.beats},
                    waiting_ranks=sorted(waiting), process_states=states, where=where,
                    timeouts=first.get("timeouts", {}), stacks=str(self.run_dir / "logs" / "stacks-rank-*.txt"))
        events.close()
        self.say(f"keel: hang: {reason}; stacks in {self.run_dir / 'logs'}; ending the workers"
                 + (" to restart them from the latest checkpoint" if restarting else ""))

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
