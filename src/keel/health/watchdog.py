"""The hang watchdog: one thread per rank that knows which section of the loop its rank is in.

Sections are `setup` (process group to the first step), `step`, `checkpoint` and `eval`. Each has a
timeout: configured at first, then learned from the longest duration observed × `factor`, stored in
the train state so that a restarted run is protected from its first step. The timeouts keep an
explicit order: collective (the process groups' own timeout, half a step's) < step < rendezvous (the
launcher's, for a restart). Within a step the loop marks its progress (`phase`), so that when one rank
sleeps and the others wait for it in a collective, the sleeper can be told from the waiters.

On a hang, found by this thread (a section past its timeout) or by the main thread (a collective
that timed out), the rank writes every thread's Python stack to `logs/stacks-rank-R.txt`
(faulthandler) and raises the alarm in the process group's store. Every rank's watchdog sees it,
writes its stacks and publishes where it is; the rank that raised the alarm names the stuck ranks in
a `hang` event; then all abort the process group and exit with EXIT_HANG, so that the elastic agent
restarts the workers, which resume from the latest verified checkpoint.

A rank that cannot run Python at all (stopped, or stuck holding the GIL) cannot answer, and if it is
rank 0 neither can the store. Under `keel train` this thread also beats (keel.health.heartbeat), and
from the moment a rank handles a hang its beats say so (`hang`: what it saw, and once known, whether
the reporter named the stuck ranks or left them to the launcher, with the ranks that did not answer):
the node's launcher names such a rank from its process state, its silent heartbeat and the ranks
that did not answer, never a rank that waits for it. Without a launcher, the reporter names them
itself, and faulthandler's own timer ends a rank stuck holding the GIL.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch.distributed as dist

from keel.config import WatchdogConfig
from keel.core.torch_private import abort_process_group, default_store, process_groups, set_group_timeout
from keel.errors import EXIT_HANG
from keel.health.heartbeat import STACKS_SIGNAL, beat, beat_path, heartbeat_dir
from keel.rundir.events import EventLog
from keel.rundir.quarantine import node_name

SECTIONS = ("setup", "step", "checkpoint", "eval")
PHASES = ("data", "forward_backward", "reduce", "update")  # progress marks within a step, in order
COLLECTIVE_SHARE = 0.5  # a collective's timeout is this share of its step's
BACKSTOP_GRACE_S = 60.0
ABORT_S = 5.0  # the longest abort_process_groups waits


def verdict_wait_s(poll_s: float) -> float:
    """How long a rank waits for the reporter's verdict (the reporter collects for less)."""
    return 4 * poll_s + 5


class Watchdog:
    def __init__(self, cfg: WatchdogConfig, run_dir: Path, rank: int, world: int, events: EventLog,
                 say: Callable[[str], None], hosts: list[str] | None = None) -> None:
        self.cfg, self.rank, self.world, self.events, self.say = cfg, rank, world, events, say
        self.hosts = hosts or []
        self.logs = run_dir / "logs"
        self.timeouts = {"setup": cfg.setup_timeout_s, "step": cfg.initial_timeout_s,
                         "checkpoint": cfg.initial_timeout_s, "eval": cfg.initial_timeout_s}
        self.longest: dict[str, float] = {}  # section → longest duration seen (steps after the warm-up only)
        self.steps_seen = 0
        self.section_name, self.section_step, self.section_start = "setup", 0, time.monotonic()
        self.phase_index = 0
        self.prefix = f"keel/watchdog/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._stacks: IO[str] | None = None
        self._exit: Callable[[int], None] = os._exit
        self._handling = threading.Lock()  # the thread and the main thread may both meet the hang
        self.reporter = False
        self.alarm: dict[str, object] = {}
        self.heartbeats = heartbeat_dir() if cfg.enabled else None  # set when a launcher watches this worker
        self._promised: tuple[str, float] = ("", -1.0)  # the last beat's section, and the seconds it promised
        self.hang: dict[str, Any] | None = None  # once this rank handles a hang: what its beats tell the launcher
        # The loop and this thread both beat: one at a time, or a beat read before the other's and renamed
        # after it would name a section the rank has left (until the next poll).
        self._beating = threading.Lock()

    # ------------------------------------------------------------ what the loop calls

    def start(self) -> None:
        if not self.cfg.enabled:
            return
        self.logs.mkdir(parents=True, exist_ok=True)
        self._stacks = open(self.logs / f"stacks-rank-{self.rank}.txt", "a")  # noqa: SIM115 (open for the run)
        self._arm_backstop(self.timeouts["setup"])
        faulthandler.register(STACKS_SIGNAL, file=self._stacks, all_threads=True)  # `kill -USR2` for stacks
        self._beat()
        self._thread = threading.Thread(target=self._watch, name="keel-watchdog", daemon=True)
        self._thread.start()

    def begin(self, name: str, step: int) -> None:
        """Enter a section (the one before, if not ended, is left unmeasured: e.g. a step rolled back)."""
        self.section_name, self.section_step, self.phase_index = name, step, 0
        self.section_start = time.monotonic()
        self._arm_backstop(self.timeouts[name])
        if (name, self.timeouts[name]) != self._promised:
            self._beat()  # at once: a beat left from another section names it, and promises its timeout

    def end(self) -> None:
        self._observed(self.section_name, time.monotonic() - self.section_start)
        self.section_name = "idle"

    def phase(self, name: str) -> None:
        self.phase_index = PHASES.index(name)

    def collective_timed_out(self, error: BaseException) -> None:
        """The main thread's collective gave up waiting: a peer is stuck. Never returns."""
        self._on_hang(f"a collective timed out in {self.section_name} ({str(error).splitlines()[0][:200]})")

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self.cfg.enabled:
            faulthandler.cancel_dump_traceback_later()
            faulthandler.unregister(STACKS_SIGNAL)
        if self.heartbeats is not None:  # the worker ends: no beat is missing from here on
            beat_path(self.heartbeats, self.rank).unlink(missing_ok=True)
        if self._stacks is not None:
            self._stacks.close()
            self._stacks = None
            path = self.logs / f"stacks-rank-{self.rank}.txt"
            if path.stat().st_size == 0:
                path.unlink()  # nothing was dumped

    # ------------------------------------------------------------ learned timeouts

    def _observed(self, name: str, seconds: float) -> None:
        if name == "step":
            self.steps_seen += 1
            if self.steps_seen <= self.cfg.warmup_steps:  # the first steps compile, allocate and warm caches
                if self.steps_seen == self.cfg.warmup_steps:
                    self._learn("step", seconds)
                return
        if name != "setup":
            self._learn(name, seconds)

    def _learn(self, name: str, seconds: float) -> None:
        longest = max(self.longest.get(name, 0.0), seconds)
        self.longest[name] = longest
        before = self.timeouts[name]
        self.timeouts[name] = max(self.cfg.min_timeout_s, self.cfg.factor * longest)
        if name == "step" and self.timeouts[name] != before:
            set_collective_timeout(self.timeouts["step"] * COLLECTIVE_SHARE)

    def collective_timeout(self) -> float:
        return self.timeouts["step"] * COLLECTIVE_SHARE

    def describe(self, rendezvous_s: float | None) -> str:
        order = (f"collective {self.collective_timeout():.0f} s < step {self.timeouts['step']:.0f} s"
                 + (f" < rendezvous {rendezvous_s:.0f} s" if rendezvous_s else ""))
        learned = "learned" if "step" in self.longest else f"until learned after {self.cfg.warmup_steps} steps"
        return (f"watchdog timeouts ({learned}): {order}; checkpoint {self.timeouts['checkpoint']:.0f} s, eval "
                f"{self.timeouts['eval']:.0f} s, setup {self.timeouts['setup']:.0f} s")

    def state_dict(self) -> dict:
        return {"timeouts": dict(self.timeouts), "longest": dict(self.longest)}

    def load_state_dict(self, state: dict) -> None:
        self.timeouts.update(state.get("timeouts", {}))
        self.longest.update(state.get("longest", {}))
        if "step" in self.longest:
            self.steps_seen = self.cfg.warmup_steps  # learned already: every step counts from here on
            set_collective_timeout(self.collective_timeout())

    # ------------------------------------------------------------ the watching thread

    def _arm_backstop(self, timeout_s: float) -> None:
        """faulthandler's own thread needs no GIL: well past the timeout (time for this thread to have
        handled the hang, had it been able to run) it dumps the stacks and ends the process."""
        if self._stacks is not None:
            faulthandler.dump_traceback_later(2 * timeout_s + BACKSTOP_GRACE_S, exit=True, file=self._stacks)

    def _watch(self) -> None:
        store = _store()
        while not self._stop.wait(self.cfg.poll_s):
            self._beat()
            name = self.section_name
            if name in self.timeouts and time.monotonic() - self.section_start > self.timeouts[name]:
                self._on_hang(f"{name} of step {self.section_step} ran past its {self.timeouts[name]:.0f} s "
                              f"timeout on rank {self.rank}")
            try:
                if store is not None and store.check([self.prefix + "alarm"]):
                    self._on_hang(None)
            except Exception:  # noqa: BLE001 - the store lives in rank 0: if it is gone, so is the job
                store = None

    def _beat(self, valid_s: float | None = None) -> None:
        """Tell the launcher where this rank is, and until when to expect the next beat: within the
        section's timeout (a rank further from its last beat than that cannot run Python)."""
        if self.heartbeats is None:
            return
        host = self.hosts[self.rank] if self.rank < len(self.hosts) else node_name()
        with self._beating, contextlib.suppress(OSError):
            where = self._where()
            promised = valid_s or self.timeouts.get(where["section"], self.timeouts["step"])
            self._promised = (where["section"], promised)
            record = {"where": where, "host": host, "timeouts": self._rounded()}
            beat(self.heartbeats, self.rank, {**record, "hang": self.hang} if self.hang else record, promised)

    def _rounded(self) -> dict[str, float]:
        return {k: round(v, 1) for k, v in self.timeouts.items()}

    def _where(self) -> dict:
        return {"rank": self.rank, "section": self.section_name, "step": self.section_step,
                "phase": PHASES[self.phase_index] if self.section_name == "step" else self.section_name,
                "progress": [self.section_step, self.phase_index],
                "elapsed_s": round(time.monotonic() - self.section_start, 2)}

    def _raise_alarm(self, reason: str) -> None:
        store = _store()
        self.reporter = False
        if store is not None:
            with contextlib.suppress(Exception):
                self.reporter = store.add(self.prefix + "detectors", 1) == 1
                if self.reporter:
                    store.set(self.prefix + "alarm", json.dumps({"by": self.rank, "reason": reason}))
        else:
            self.reporter = True
        if self.reporter:
            self.alarm = {"by": self.rank, "reason": reason}

    def _on_hang(self, reason: str | None) -> None:
        """Dump this rank's stacks, raise the alarm if this rank found the hang (`reason`), say where it
        is, let the reporter name the stuck ranks, then exit. Never returns. The stacks come first: they
        need no peer, and the store may live in a stuck rank 0."""
        if not self._handling.acquire(blocking=False):
            while True:  # the other thread is on it and will end the process
                time.sleep(1)
        faulthandler.cancel_dump_traceback_later()  # handled here: the backstop must not cut it short
        # From here on every beat says this rank waits on a hang (`named`: not known yet), not that it is one.
        self.hang = {"reason": reason or "the alarm of another rank", "named": None}
        self._beat(valid_s=self._handling_s())  # beats may stop while it is handled
        if self._stacks is not None:
            self._stacks.write(f"\n=== rank {self.rank}: hang at {time.strftime('%Y-%m-%d %H:%M:%S')}, "
                               f"{json.dumps(self._where())}\n")
            self._stacks.flush()
            faulthandler.dump_traceback(file=self._stacks, all_threads=True)
            self._stacks.flush()
        # The store may be out of reach (this node cut off by a network fault), and a store call then waits on
        # a connection that never answers: the consultation gets the time a verdict takes, then the rank goes.
        consult = threading.Thread(target=self._consult, args=(reason,), name="keel-hang", daemon=True)
        consult.start()
        consult.join(self._handling_s() - ABORT_S)
        abort_process_groups()
        self._exit(EXIT_HANG)

    def _consult(self, reason: str | None) -> None:
        """Through the store: raise the alarm if this rank found the hang, say where it is, and as the reporter
        name the stuck ranks, or else wait for the reporter's verdict."""
        store = _store()
        if reason is not None:
            self._raise_alarm(reason)
        with contextlib.suppress(Exception):
            if store is not None:
                store.set(f"{self.prefix}where/{self.rank}", json.dumps(self._where()))
        if self.reporter:
            self._report(store)
        else:
            verdict = _wait_for(store, self.prefix + "verdict", verdict_wait_s(self.cfg.poll_s))
            self.hang = {**(self.hang or {}), "named": verdict.get("named"), "by": verdict.get("by")}
            self._beat(valid_s=self._handling_s())

    def _handling_s(self) -> float:
        return verdict_wait_s(self.cfg.poll_s) + ABORT_S + 5

    def _report(self, store: Any) -> None:
        deadline = time.monotonic() + 3 * self.cfg.poll_s + 3
        where: dict[int, dict] = {}
        while time.monotonic() < deadline and len(where) < self.world:
            for r in range(self.world):
                if r not in where:
                    with contextlib.suppress(Exception):
                        if store is None and r == self.rank:
                            where[r] = self._where()
                        elif store is not None and store.check([f"{self.prefix}where/{r}"]):
                            where[r] = json.loads(store.get(f"{self.prefix}where/{r}"))
            time.sleep(0.2)
        stuck = stuck_ranks(where, self.world)
        named = self.heartbeats is None or len(where) == self.world
        silent = [] if named else stuck
        self.hang = {**(self.hang or {}), "named": named, "by": self.rank, "silent": silent,
                     "silent_hosts": [self.hosts[r] if r < len(self.hosts) else "unknown" for r in silent]}
        self._beat(valid_s=self._handling_s())  # the launcher may act on it at once
        if not named:
            # Ranks that cannot answer cannot run Python: the launchers watching their heartbeats and process
            # states name them.
            self.say(f"error: hang: rank(s) {', '.join(map(str, stuck))} did not answer ({self.alarm['reason']}); "
                     f"their launcher names them; exiting so that the workers restart from the latest checkpoint")
        else:
            self.events.emit("hang", self.section_step, "restart", stuck_ranks=stuck,
                             hosts=[self.hosts[r] for r in stuck if r < len(self.hosts)],
                             section=where.get(stuck[0], {}).get("section", "unknown") if stuck else "unknown",
                             reason=self.alarm["reason"], detected_by=self.rank, where=where,
                             timeouts=self._rounded(), stacks=str(self.logs / "stacks-rank-*.txt"))
            self.say(f"error: hang: rank(s) {', '.join(map(str, stuck))} stuck ({self.alarm['reason']}); stacks "
                     f"in {self.logs}; exiting so that the agent restarts the workers from the latest checkpoint")
        with contextlib.suppress(Exception):
            if store is not None:
                store.set(self.prefix + "verdict", json.dumps({"stuck": stuck, "named": named, "by": self.rank}))
        time.sleep(1.0)  # the store lives in rank 0: let the others read the verdict before it goes


def stuck_ranks(where: dict[int, dict], world: int) -> list[int]:
    """Ranks that could not say where they are, else those furthest behind: in a hang the others wait
    for them in a collective, further on. When all are at the same place, all are named."""
    silent = [r for r in range(world) if r not in where]
    if silent:
        return silent
    behind = min(tuple(w["progress"]) for w in where.values())
    return sorted(r for r, w in where.items() if tuple(w["progress"]) == behind)


def _store() -> Any:
    if not dist.is_initialized():
        return None
    try:
        return default_store()
    except (ValueError, RuntimeError):
        return None


def _wait_for(store: Any, key: str, timeout_s: float) -> dict:
    """The JSON value of `key` once set, {} when it is not within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while store is not None and time.monotonic() < deadline:
        try:
            if store.check([key]):
                return json.loads(store.get(key))
        except Exception:  # noqa: BLE001 - rank 0 (the store) has gone: nothing more to wait for
            return {}
        time.sleep(0.2)
    return {}


def set_collective_timeout(seconds: float) -> None:
    """The process groups' own timeout: a collective waiting longer than this raises in the main thread."""
    if not dist.is_initialized():
        return
    for group in process_groups():
        with contextlib.suppress(Exception):
            set_group_timeout(seconds, group)


def abort_process_groups() -> None:
    """Tear the communicators down without waiting for peers (bounded: an abort must not hang too)."""
    if not dist.is_initialized():
        return

    def abort() -> None:
        with contextlib.suppress(Exception):  # not every backend can abort; exiting closes its sockets anyway
            abort_process_group()

    thread = threading.Thread(target=abort, daemon=True)
    thread.start()
    thread.join(timeout=5)


def is_collective_timeout(error: BaseException) -> bool:
    text = str(error).lower()
    return isinstance(error, RuntimeError) and ("timed out" in text or "timeout" in text)
