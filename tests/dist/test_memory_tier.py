"""The memory tier in real runs: a rank SIGKILLed at a random step is restarted alone by the launcher
(`health.in_process_restart`), the other rank keeping its process; both restore the newest checkpoint held in the
node's shared memory without opening a file of the checkpoint storage (an inotify watch on it, ordered against
the memory tier's next save), and end bitwise equal to the run that never failed. (The restart of every worker
from the memory tier is the drill's: kill_restored_from_memory, kill_during_memory_save.)"""

from __future__ import annotations

import ctypes
import json
import os
import random
import struct
import threading
import time
from pathlib import Path

import pytest

from keel.checkpoint.inspect import state_sha256
from keel.checkpoint.memory import memory_root
from keel.report.status import summary, summary_lines
from keel.rundir.events import read_jsonl
from keel.rundir.quarantine import node_name
from tests.conftest import SMALL_RUN, kill_tagged, spawn_keel

pytestmark = pytest.mark.dist

IN_ACCESS, IN_OPEN, IN_MOVED_TO, IN_CREATE, IN_ISDIR = 0x1, 0x20, 0x80, 0x100, 0x40000000
EVENT = struct.Struct("iIII")  # struct inotify_event: wd, mask, cookie, len (then the name)


class Watch:
    """inotify on the memory tier's directory (a save creates its staging directory there) and on the committed
    storage checkpoints' directories (any file opened or read in them), its events kept in the order the kernel
    queued them."""

    def __init__(self, memory: Path, checkpoint_dirs: list[Path]) -> None:
        self.libc = ctypes.CDLL("libc.so.6", use_errno=True)
        self.fd = self.libc.inotify_init1(os.O_NONBLOCK)
        assert self.fd >= 0, os.strerror(ctypes.get_errno())
        self.names = {self._add(memory, IN_CREATE | IN_MOVED_TO): "memory"}
        self.names.update({self._add(d, IN_OPEN | IN_ACCESS): d.name for d in checkpoint_dirs})
        self.seen: list[tuple[str, int, str]] = []  # (what, mask, file name)
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _add(self, path: Path, mask: int) -> int:
        wd = self.libc.inotify_add_watch(self.fd, str(path).encode(), mask)
        assert wd >= 0, f"{path}: {os.strerror(ctypes.get_errno())}"
        return wd

    def _read(self) -> None:
        while not self.done.is_set():
            try:
                data = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                time.sleep(0.005)
                continue
            at = 0
            while at < len(data):
                wd, mask, _, size = EVENT.unpack_from(data, at)
                name = data[at + EVENT.size:at + EVENT.size + size].rstrip(b"\0").decode()
                self.seen.append((self.names.get(wd, "?"), mask, name))
                at += EVENT.size + size

    def close(self) -> None:
        self.done.set()
        self.thread.join()
        os.close(self.fd)

    def opened_before_save_of(self, step: int) -> list[str]:
        """The storage files opened or read before the memory tier began its save of a step after `step` (listing
        a checkpoint's directory reads none of its bytes)."""
        opened = []
        for what, mask, name in self.seen:
            if what == "memory":
                if name.startswith("step-") and int(name[5:11]) > step:
                    return opened
            elif not mask & IN_ISDIR:
                opened.append(f"{what}/{name}")
        raise AssertionError(f"the memory tier saved no step after {step} while watched: {self.seen}")


def _wait_for(path: Path, found, timeout: float = 120.0) -> tuple[int, dict]:
    """The first record of the JSONL file `path` that `found` accepts, with its index."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            for i, record in enumerate(read_jsonl(path)):
                if found(record):
                    return i, record
        time.sleep(0.02)
    raise AssertionError(f"no such record in {path} after {timeout} s")


def test_a_rank_killed_at_a_random_step_is_restarted_alone_restores_from_memory_reading_no_storage_and_ends_bitwise(
        small_corpus: Path, reference_run: Path, tmp_path: Path) -> None:
    # Storage saves at 20 and 40, memory every 5 steps. The kill comes after the save of step 20 has settled, not
    # in the step after a memory save (whose write may not be committed yet), and early enough for a memory save
    # before step 40: until then nothing of the run has a reason to read the storage tier. Every step is made
    # 0.2 s slower (the math untouched), longer than a save takes to write, as a step of a real model is.
    step = random.choice([s for s in range(23, 36) if s % 5 != 1])
    run_dir = tmp_path / "killed"
    args = ["train", "--nproc", "2", "--max-restarts", "1", "--run-dir", str(run_dir), *SMALL_RUN,
            "train.steps=40", f"data.dir={small_corpus}", "checkpoint.interval=20", "checkpoint.keep_last=10",
            "checkpoint.memory_interval=5", "health.in_process_restart=true",
            f'drill.inject=["kill:step={step},rank=1", "slow:rank=-1,seconds=0.2"]']
    memory = memory_root("", run_dir, node_name())
    with (tmp_path / "out.log").open("w") as out, (tmp_path / "err.log").open("w") as err:
        proc, tag = spawn_keel(args, tmp_path, text=True, stdout=out, stderr=err)
    watch = None
    try:
        events_log = run_dir / "events.jsonl"
        _wait_for(events_log, lambda r: r["kind"] == "drill" and r["action"] == "inject" and r["step"] == step)
        stored = sorted(p for p in (run_dir / "checkpoints").glob("step-*") if (p / "manifest.json").exists())
        held = max(int(p.name[5:11]) for p in memory.glob("step-*"))
        watch = Watch(memory, stored)
        assert proc.wait(timeout=180) == 0, (tmp_path / "err.log").read_text()[-3000:]
    finally:
        if watch is not None:
            watch.close()
        kill_tagged(tag)
    newest = (step - 1) // 5 * 5
    assert [p.name for p in stored] == ["step-000020"], "the storage tier had its own checkpoint"
    assert watch.opened_before_save_of(held) == [], f"the restore read the checkpoint storage (killed in {step})"
    events = read_jsonl(run_dir / "events.jsonl")
    (restored,) = [r for r in events if r["kind"] == "memory" and r["action"] == "restored"]
    (resumed,) = [r for r in events if r["kind"] == "resume"]
    assert (restored["step"], resumed["step"]) == (newest, newest), f"killed in step {step}"
    assert restored["detail"]["path"] == f"{memory}/step-{newest:06d}" and step - newest <= 5
    assert resumed["detail"]["tier"] == "memory"
    goodput = json.loads((run_dir / "goodput.json").read_text())
    assert [(r["step"], r["tier"]) for r in goodput["restores"]] == [(newest, "memory")]
    assert set(goodput["restore_s_by_tier"]) == {"memory"}
    status = "\n".join(summary_lines(summary(run_dir)))
    assert f"last restore: step {newest} from the memory tier" in status
    assert "in-process: rank(s) 1 restarted alone, the others kept their processes" in status
    assert state_sha256(run_dir / "checkpoints" / "step-000040") == \
        state_sha256(reference_run / "checkpoints" / "step-000040"), f"killed in step {step}"
    assert not memory.exists(), "the launcher removes the memory tier when the job ends"
    restarts = [r for r in events if r["kind"] == "failure"]
    assert [(r["action"], r["detail"]["ranks"]) for r in restarts] == [("in_process", [1])], json.dumps(restarts)
    pids = {rank: [r["detail"]["pid"] for r in events if r["kind"] == "start" and r["rank"] == rank] for rank in (0, 1)}
    assert len(pids[0]) == 2 and len(set(pids[0])) == 1, f"rank 0 kept its process: {pids}"
    assert len(set(pids[1])) == 2, f"rank 1 was replaced: {pids}"
    assert "rejoins the job (generation 1)" in (tmp_path / "err.log").read_text()
