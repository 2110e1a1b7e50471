"""The health parts that need no process group: the watchdog's learning and verdict, signals and the
pause file, and preflight's attribution."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from keel.config import StragglerConfig, WatchdogConfig
from keel.errors import EXIT_HANG
from keel.health.heartbeat import ENV, STACKS_SIGNAL, HeartbeatWatch, Sighting, culprits, cut_off, read_beat
from keel.health.preflight import Check, blame_senders, slow_ranks, storage_checks
from keel.health.signals import PAUSE_FILE, StopRequests, request_pause
from keel.health.straggler import slow_nodes
from keel.health.watchdog import Watchdog, stuck_ranks
from keel.rundir.events import EventLog, read_jsonl
from keel.rundir.quarantine import node_name
from tests.conftest import keel_env


def where(step: int, phase: int) -> dict:
    return {"progress": [step, phase]}


def test_stuck_ranks_are_the_silent_then_the_furthest_behind() -> None:
    assert stuck_ranks({0: where(30, 2), 1: where(30, 1), 2: where(30, 2)}, 3) == [1]
    assert stuck_ranks({0: where(30, 2), 2: where(30, 2)}, 3) == [1]  # rank 1 could not even answer
    assert stuck_ranks({0: where(31, 0), 1: where(30, 3)}, 2) == [1]
    assert stuck_ranks({0: where(30, 2), 1: where(30, 2)}, 2) == [0, 1]  # all at the same place: all named


def make_watchdog(tmp_path: Path, **kw: float) -> tuple[Watchdog, list[str]]:
    said: list[str] = []
    cfg = WatchdogConfig(**{"warmup_steps": 3, "factor": 5.0, "min_timeout_s": 1.0, **kw})
    return Watchdog(cfg, tmp_path, 0, 1, EventLog(tmp_path / "events.jsonl", 0), said.append), said


def test_watchdog_learns_step_timeouts_after_warmup_in_order(tmp_path: Path) -> None:
    dog, _ = make_watchdog(tmp_path)
    assert dog.timeouts["step"] == 900.0  # the configured value until learned
    for seconds in (5.0, 0.1, 0.1):  # the warm-up: only its last step counts
        dog._observed("step", seconds)
    assert dog.timeouts["step"] == 1.0  # max(min_timeout_s, 5 × 0.1)
    dog._observed("step", 0.4)
    assert dog.timeouts["step"] == pytest.approx(2.0)
    assert dog.collective_timeout() < dog.timeouts["step"] < 900
    assert "collective 1 s < step 2 s < rendezvous 900 s" in dog.describe(900)
    dog._observed("checkpoint", 3.0)
    assert dog.timeouts["checkpoint"] == pytest.approx(15.0)
    restored, _ = make_watchdog(tmp_path)
    restored.load_state_dict(json.loads(json.dumps(dog.state_dict())))  # as the train state stores it
    assert restored.timeouts == dog.timeouts and restored.steps_seen == 3
    restored._observed("step", 0.6)  # learned already: no new warm-up after a restart
    assert restored.timeouts["step"] == pytest.approx(3.0)


def test_watchdog_finds_a_stuck_step_dumps_stacks_and_exits(tmp_path: Path) -> None:
    dog, said = make_watchdog(tmp_path, poll_s=0.1)
    exits: list[int] = []
    dog._exit = exits.append  # the real one ends the process
    dog.timeouts["step"] = 0.3
    dog.start()
    try:
        dog.begin("step", 7)
        dog.phase("forward_backward")
        deadline = time.monotonic() + 10
        while not exits and time.monotonic() < deadline:
            time.sleep(0.05)  # this thread is "stuck" in step 7
    finally:
        dog.stop()
    assert exits == [EXIT_HANG]
    (hang,) = [e for e in read_jsonl(tmp_path / "events.jsonl") if e["kind"] == "hang"]
    assert hang["step"] == 7 and hang["detail"]["stuck_ranks"] == [0] and hang["detail"]["section"] == "step"
    assert "ran past its 0 s timeout" in hang["detail"]["reason"]
    stacks = (tmp_path / "logs" / "stacks-rank-0.txt").read_text()
    assert "test_watchdog_finds_a_stuck_step_dumps_stacks_and_exits" in stacks  # the main thread's stack
    assert any("hang: rank(s) 0 stuck" in line for line in said)


def test_watchdog_beats_where_its_rank_is_and_dumps_its_stacks_on_sigusr2(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    beats = tmp_path / "beats"
    beats.mkdir()
    monkeypatch.setenv(ENV, str(beats))
    dog, _ = make_watchdog(tmp_path, poll_s=0.05)
    dog.timeouts["step"] = 7.0
    dog.start()
    try:
        dog.begin("step", 3)
        deadline = time.monotonic() + 10
        while ((last := read_beat(beats, 0)) is None or last["where"]["step"] != 3) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert last is not None and last["where"]["section"] == "step" and last["where"]["step"] == 3, last
        assert last["pid"] == os.getpid() and last["valid_s"] == 7.0 and last["host"] == node_name()
        os.kill(os.getpid(), STACKS_SIGNAL)  # answered by faulthandler, whatever Python is doing
        stacks = (tmp_path / "logs" / "stacks-rank-0.txt").read_text()
        assert "test_watchdog_beats_where_its_rank_is_and_dumps_its_stacks_on_sigusr2" in stacks
    finally:
        dog.stop()
    assert read_beat(beats, 0) is None  # an ending worker leaves no beat to be taken for a frozen one


def test_a_new_section_beats_at_once_even_when_its_timeout_is_the_same(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank frozen just after a checkpoint is named in its step, not in the checkpoint before it."""
    beats = tmp_path / "beats"
    beats.mkdir()
    monkeypatch.setenv(ENV, str(beats))
    dog, _ = make_watchdog(tmp_path, poll_s=3600)  # no beats from the thread: only those begin() writes
    dog.timeouts.update(step=4.0, checkpoint=4.0)
    dog.start()
    try:
        seen = []
        for name, step in (("checkpoint", 30), ("step", 31), ("step", 32)):
            dog.begin(name, step)
            seen.append(read_beat(beats, 0)["where"])  # type: ignore[index]
            dog.end()
        assert [(w["section"], w["step"]) for w in seen] == [("checkpoint", 30), ("step", 31), ("step", 31)]
    finally:
        dog.stop()


WORKER = """
import sys, time
from pathlib import Path
from keel.config import WatchdogConfig
from keel.health.watchdog import Watchdog
from keel.rundir.events import EventLog
rank, run_dir = int(sys.argv[1]), Path(sys.argv[2])
dog = Watchdog(WatchdogConfig(initial_timeout_s=1.0, min_timeout_s=1.0, poll_s=0.1), run_dir, rank, 2,
               EventLog(run_dir / f"worker-{rank}.jsonl", rank), print)
dog.start()
for step in range(1, 1000):
    dog.begin("step", step)
    time.sleep(0.1)
    dog.end()
"""


def test_the_watchdog_thread_never_replaces_a_newer_beat_of_the_loop(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The thread reads "idle" and is held in its write while the loop enters step 31 and beats: the beat
    left in place is the loop's, or a rank stopped right then would be named in the wrong section."""
    import keel.health.watchdog as watchdog_module

    beats = tmp_path / "beats"
    beats.mkdir()
    monkeypatch.setenv(ENV, str(beats))
    dog, _ = make_watchdog(tmp_path, poll_s=3600)  # the test plays the thread's part itself
    dog.timeouts.update(step=4.0, checkpoint=4.0)
    dog.start()
    writing, loop_beat = threading.Event(), threading.Event()
    original = watchdog_module.beat

    def held_beat(*args: object) -> None:
        if threading.current_thread() is not threading.main_thread():
            writing.set()
            loop_beat.wait(timeout=1.0)  # without the order of beats, the loop's lands while this one waits
        original(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(watchdog_module, "beat", held_beat)
    try:
        dog.begin("checkpoint", 30)
        dog.end()
        thread = threading.Thread(target=dog._beat)
        thread.start()
        assert writing.wait(timeout=5)
        dog.begin("step", 31)
        loop_beat.set()
        thread.join()
        assert read_beat(beats, 0)["where"]["section"] == "step"  # type: ignore[index]
    finally:
        dog.stop()


def test_launcher_names_a_stopped_worker_dumps_the_others_stacks_and_ends_both(tmp_path: Path) -> None:
    watch = HeartbeatWatch(tmp_path)  # the workers inherit where to beat
    workers = [subprocess.Popen([sys.executable, "-c", WORKER, str(r), str(tmp_path)], env=keel_env())
               for r in (0, 1)]
    try:
        pids = {r: w.pid for r, w in enumerate(workers)}
        deadline = time.monotonic() + 60
        while any((b := read_beat(watch.directory, r)) is None or b["pid"] != pid or b["where"]["section"] != "step"
                  for r, pid in pids.items()):  # past setup (whose timeout is 30 minutes), in their steps
            assert time.monotonic() < deadline and all(w.poll() is None for w in workers), "the workers did not beat"
            time.sleep(0.05)
        assert not watch.end_hang(pids, restarting=True)  # both beat: nothing to do
        os.kill(pids[0], signal.SIGSTOP)
        stopped = time.monotonic()
        while not watch.end_hang(pids, restarting=True):
            assert time.monotonic() - stopped < 10, "the stopped worker was not found"
            time.sleep(0.05)
        found = time.monotonic() - stopped
        assert [w.wait(timeout=5) for w in workers] == [-signal.SIGKILL] * 2
    finally:
        for w in workers:
            w.kill()
            w.wait()
        watch.close()
    assert 0.8 <= found <= 1.0 + 3, found  # its beat held for its step timeout, 1 s
    (hang,) = read_jsonl(tmp_path / "events.jsonl")
    detail = hang["detail"]
    assert hang["kind"] == "hang" and hang["rank"] == -1 and detail["stuck_ranks"] == [0], hang
    assert detail["hosts"] == [node_name()] and detail["section"] == "step" and detail["detected_by"] == "launcher"
    assert detail["process_states"]["0"] == "stopped" and detail["process_states"]["1"] != "stopped"
    assert "rank 0 (pid" in detail["reason"] and "past its 1 s step timeout" in detail["reason"]
    stacks = (tmp_path / "logs" / "stacks-rank-1.txt").read_text()
    assert "stacks asked by the launcher" in stacks and "in <module>" in stacks.split("asked by the launcher")[1]
    assert not (tmp_path / "logs" / "stacks-rank-0.txt").read_text()  # a stopped process dumps nothing
    assert ENV not in os.environ and not watch.directory.exists()


def beat_of(step: int, phase: int, age_s: float = 0.0, valid_s: float = 4.0, hang: dict | None = None) -> dict:
    phases = ("data", "forward_backward", "reduce", "update")
    where = {"section": "step", "step": step, "phase": phases[phase], "progress": [step, phase]}
    return {"where": where, "time": 1000.0 - age_s, "valid_s": valid_s, "host": "h", "timeouts": {},
            **({"hang": hang} if hang else {})}


def sighting(beats: dict[int, dict], states: dict[int, str | None] | None = None,
             exits: dict[int, int | None] | None = None) -> Sighting:
    ranks = range(len(beats))
    return Sighting({r: 100 + r for r in ranks}, beats, {r: "S" for r in ranks} | (states or {}),
                    {r: None for r in ranks} | (exits or {}), 1000.0)


WAITS = {"reason": "a collective timed out in step", "named": None}  # a rank's beat while it handles a hang


def test_the_launcher_names_the_rank_that_stopped_making_progress_never_its_waiting_peer() -> None:
    # Rank 0 stopped (it hosts the store): rank 1's collective timed out, and its own beat expired while it
    # was blocked on rank 0's store. The stopped rank is the hang, whatever the beats say.
    seen = sighting({0: beat_of(35, 1, age_s=2), 1: beat_of(35, 2, age_s=20, valid_s=17, hang=WAITS)}, {0: "T"})
    assert seen.hang_seen() and list(culprits(seen)) == [0]
    assert "rank 0 (pid 100, stopped) sent no heartbeat for 2.0 s (forward_backward of step 35)" in culprits(seen)[0]
    # Four ranks, rank 2 stopped, the others waiting on it: found as soon as one waits, before any beat expires.
    four = sighting({r: beat_of(20, 2, hang=WAITS if r != 2 else None) for r in range(4)}, {2: "T"})
    assert four.hang_seen() and list(culprits(four)) == [2]
    # Rank 1 holds the GIL in a busy loop (running, no beat): the reporter, rank 0, left it to the launcher.
    deferred = {"reason": "a collective timed out in step", "named": False, "by": 0, "silent": [1]}
    busy = sighting({0: beat_of(12, 2, hang=deferred), 1: beat_of(12, 1, age_s=3)}, {1: "R"})
    assert busy.hang_seen() and culprits(busy) == {1: "rank 1 (pid 101, running) did not answer rank 0's alarm"}
    # Its beat expired before anyone's collective timed out: frozen.
    frozen = sighting({0: beat_of(12, 2), 1: beat_of(12, 1, age_s=5)}, {1: "R"})
    assert frozen.hang_seen() and list(culprits(frozen)) == [1]
    # Only a worker's exit on a hang is left (the reporter's beat was lost): the rank furthest behind.
    behind = sighting({0: beat_of(12, 2, hang=WAITS), 1: beat_of(12, 3), 2: beat_of(12, 1)}, exits={0: 74})
    assert behind.hang_seen() and list(culprits(behind)) == [2]
    # A rank killed by a signal stopped making progress too.
    assert list(culprits(sighting({0: beat_of(9, 2, hang=WAITS), 1: beat_of(9, 1)}, {1: None}, {1: -9}))) == [1]


def test_the_launcher_leaves_alone_what_is_no_hang_or_was_named_by_a_worker() -> None:
    assert not sighting({0: beat_of(5, 1), 1: beat_of(5, 2)}).hang_seen()
    # Stopped, but nobody waits for it (yet): a rank may be stopped and continued on purpose.
    assert not sighting({0: beat_of(5, 1), 1: beat_of(5, 2)}, {1: "T"}).hang_seen()
    # A rank waits, and none is stopped or frozen: the reporter is still collecting where the ranks are.
    assert not sighting({0: beat_of(5, 2, hang=WAITS), 1: beat_of(5, 1)}).hang_seen()
    # The reporter named them in its own event: its peers exit on their own.
    named = {"reason": "a collective timed out in step", "named": True, "by": 0, "silent": []}
    assert sighting({0: beat_of(5, 2, hang=named), 1: beat_of(5, 1, hang=WAITS)}, exits={1: 74}).named_by_a_worker()
    # Every rank of this node waits: the one they wait for lives on another node, whose launcher names it.
    assert culprits(sighting({0: beat_of(5, 2, hang=WAITS), 1: beat_of(5, 2, age_s=30, valid_s=17, hang=WAITS)})) == {}


def test_a_rank_of_another_node_that_never_answered_is_named_cut_off_never_the_waiter_killed_for_it() -> None:
    # Rank 0 reported a hang; rank 2, on node-1, never answered its alarm. This launcher killed its own waiting
    # rank 0 for the restart (exit -9): that is no fault of rank 0's.
    deferred = {"reason": "a collective timed out in step", "named": False, "by": 0, "silent": [2],
                "silent_hosts": ["node-1"]}
    seen = sighting({0: beat_of(20, 2, hang=deferred), 1: beat_of(20, 2, hang=WAITS)}, {0: None}, {0: -9})
    assert seen.hang_seen() and culprits(seen) == {}
    assert cut_off(seen) == {2: ("node-1", "rank 2 on node-1 did not answer rank 0's alarm: cut off from the job's "
                                           "store (a network fault), or unable to run Python")}
    # Only the reporter's own account counts, and only for ranks this launcher does not hold.
    assert cut_off(sighting({0: beat_of(20, 2, hang={**deferred, "by": 1})})) == {}
    assert cut_off(sighting({0: beat_of(20, 2, hang={**deferred, "silent": [0], "silent_hosts": ["h"]})})) == {}


def test_stop_requests_come_from_real_signals_and_the_pause_file(tmp_path: Path) -> None:
    requests = StopRequests(tmp_path, rank=0)
    try:
        assert not requests.pending()
        request_pause(tmp_path, reason="maintenance")
        assert requests.pending() and requests.reason() == "maintenance"
        requests.consume()
        assert not (tmp_path / PAUSE_FILE).exists() and not requests.pending()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert requests.pending() and requests.reason() == "SIGUSR1"
    finally:
        requests.close()
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL
    other = StopRequests(tmp_path, rank=1)  # only rank 0 reads the control file
    request_pause(tmp_path)
    try:
        assert not other.pending()
    finally:
        other.close()


def test_preflight_blames_the_sender_of_a_wrong_part() -> None:
    probes = [Check("compute_probe", True, "", rank=r, node=f"n{r}", values={"seconds": 0.01}) for r in range(3)]
    wrong_sums = [Check("allreduce_correct", False, "wrong", rank=r, node=f"n{r}") for r in range(3)]
    arrivals = [Check("allgather_correct", False, "", rank=2, values={"sender": 2, "receiver": r}) for r in range(3)]
    blamed = [c for c in blame_senders(probes + wrong_sums + arrivals) if not c.ok]
    assert [(c.name, c.rank, c.node) for c in blamed] == [("allgather_correct", 2, "n2")]
    one_receiver = [c for c in blame_senders(probes + wrong_sums[:1]) if not c.ok]
    assert [(c.name, c.rank) for c in one_receiver] == [("allreduce_correct", 0)]  # a minority: its receiving side
    slow = slow_ranks([*probes[:2], Check("compute_probe", True, "", rank=2, node="n2", values={"seconds": 0.05})])
    assert [(c.name, c.rank) for c in slow] == [("compute_speed", 2)]


def test_preflight_probes_the_checkpoint_storage(tmp_path: Path) -> None:
    checks = {c.name: c for c in storage_checks(str(tmp_path / "ckpt"), need_bytes=1 << 20, probe_bytes=1 << 20)}
    assert checks["storage_writable"].ok and checks["storage_free"].ok
    assert checks["storage_throughput"].values["write_mib_s"] > 0
    assert not (tmp_path / "ckpt").exists() and not list(tmp_path.iterdir())  # nothing created, nothing left
    full = {c.name: c for c in storage_checks(str(tmp_path / "ckpt"), need_bytes=1 << 60, probe_bytes=1 << 20)}
    assert not full["storage_free"].ok and "two checkpoints need" in full["storage_free"].detail
    blocked = tmp_path / "file"
    blocked.write_text("")
    (bad,) = storage_checks(str(blocked / "ckpt"), need_bytes=1, probe_bytes=1 << 20)
    assert not bad.ok and "is not a directory" in bad.detail


def test_straggler_config_defaults_report_within_50_steps() -> None:
    cfg = StragglerConfig()
    assert cfg.interval * (cfg.patience + 1) <= 60 and cfg.factor < 3


def test_a_slow_link_is_the_node_whose_probes_both_ways_are_slow_never_its_neighbours() -> None:
    # links[k]: the probe into node k, from node k - 1. Node 2's cable slowed: into 2 (from 1) and into 3 (from 2).
    links = [0.01, 0.012, 0.9, 0.8, 0.011]
    ((node, ratio),) = slow_nodes(links, factor=1.5)
    assert node == 2 and ratio == pytest.approx(0.8 / 0.011)
    assert slow_nodes([0.01, 0.9, 0.011], 1.5) == []  # one way slow (1 into node 1 only): no node's both ways
    assert [k for k, _ in slow_nodes([0.9, 0.01, 0.8], 1.5)] == [2]  # round the ring: node 2 sends into node 0
    assert slow_nodes([0.9, 0.8], 1.5) == []  # two nodes share one cable's two ways: whose end, none can say
    assert slow_nodes([0.01, 0.012, 0.014], 1.5) == []
    # A busy host's jitter: twice the median, but milliseconds late (seen on 3 processes on 2 cores).
    assert slow_nodes([0.0052, 0.019, 0.010], 1.5) == []


class FakeNvml:
    """NVML's Python API as nvidia-ml-py exposes it, reporting what a failing GPU would."""

    NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_VOLATILE_ECC, NVML_TEMPERATURE_GPU = 1, 0, 0
    nvmlClocksThrottleReasonHwSlowdown, nvmlClocksThrottleReasonSwThermalSlowdown = 0x8, 0x20
    nvmlClocksThrottleReasonHwThermalSlowdown = 0x40

    class NVMLError(Exception):
        pass

    def __init__(self, ecc: int, temp: int, reasons: int) -> None:
        self.ecc, self.temp, self.reasons = ecc, temp, reasons

    def nvmlInit(self) -> None: ...
    def nvmlDeviceGetHandleByIndex(self, index: int) -> int: return index
    def nvmlDeviceGetTotalEccErrors(self, handle: int, kind: int, counter: int) -> int: return self.ecc
    def nvmlDeviceGetTemperature(self, handle: int, sensor: int) -> int: return self.temp
    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: int) -> int: return self.reasons


def test_gpu_checks_read_ecc_temperature_and_throttling_through_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    import torch

    from keel.health.preflight import gpu_checks

    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml(ecc=0, temp=60, reasons=0x1))  # 0x1: idle, harmless
    assert all(c.ok for c in gpu_checks(torch.device("cuda", 0)))
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml(ecc=3, temp=91, reasons=0x40))
    failed = {c.name: c.detail for c in gpu_checks(torch.device("cuda", 0)) if not c.ok}
    assert failed == {"gpu_ecc": "GPU 0: 3 uncorrected ECC errors since boot", "gpu_temperature": "GPU 0: 91 °C",
                      "gpu_throttle": "GPU 0: clock throttle reasons 0x40"}


def test_the_collective_probe_finds_one_wrong_element_wherever_it_lies(group: None) -> None:
    import torch

    from keel.health.preflight import PATTERN, collective_checks

    numel = (1 << 20) // 4
    for index in (5, PATTERN * 7 + 3, numel - 1):
        def corrupt(tensor: torch.Tensor, at: int = index) -> None:
            tensor[at] += 1.0

        failed = [c.detail for c in collective_checks(1 << 20, torch.device("cpu"), corrupt) if not c.ok]
        assert failed[-1] == f"all-reduce result wrong in 1 of {numel} elements", index
    assert all(c.ok for c in collective_checks(1 << 20, torch.device("cpu"), None))


def test_a_preflight_probe_moves_no_more_than_the_job_itself() -> None:
    from keel.health.preflight import proportionate

    assert proportionate(64 << 20, 12 * 3_080_000) == 35 << 20  # a tiny model's checkpoint, in whole MiB
    assert proportionate(64 << 20, 4 * 8_000_000_000) == 64 << 20  # a large model: the configured size
    assert proportionate(64 << 20, 1000) == 1 << 20
