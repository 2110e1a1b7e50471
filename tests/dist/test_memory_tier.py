"""The memory tier in real runs: a rank SIGKILLed at a random step, its workers restarted by the launcher,
restore the newest checkpoint held in the node's shared memory without opening a file of the checkpoint storage
(an inotify watch on it, ordered against the run's own event log), and end bitwise equal to the run that never
failed."""

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
from keel.rundir.events import read_jsonl
from tests.conftest import SMALL_RUN, kill_tagged, spawn_keel

pytestmark = pytest.mark.dist

IN_ACCESS, IN_MODIFY, IN_OPEN, IN_ISDIR = 0x1, 0x2, 0x20, 0x40000000
EVENT = struct.Struct("iIII")  # struct inotify_event: wd, mask, cookie, len (then the name)


class Watch:
    """inotify on the event log (each record is one write, so one IN_MODIFY) and on the committed checkpoints'
    directories (any file opened or read in them), its events kept in the order the kernel queued them."""

    def __init__(self, events_log: Path, checkpoint_dirs: list[Path]) -> None:
        self.libc = ctypes.CDLL("libc.so.6", use_errno=True)
        self.fd = self.libc.inotify_init1(os.O_NONBLOCK)
        assert self.fd >= 0, os.strerror(ctypes.get_errno())
        self.names = {self._add(events_log, IN_MODIFY): "events"}
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

    def opened_before_record(self, records: int) -> list[str]:
        """The checkpoint files opened or read before the event log's `records`-th record since the watch began
        (listing a checkpoint's directory reads none of its bytes)."""
        written, opened = 0, []
        for what, mask, name in self.seen:
            if what == "events":
                written += 1
                if written == records:
                    return opened
            elif not mask & IN_ISDIR:
                opened.append(f"{what}/{name}")
        raise AssertionError(f"the watch saw {written} records of the event log, not {records}")


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


def test_a_rank_killed_at_a_random_step_restores_from_memory_reading_no_storage_and_ends_bitwise(
        small_corpus: Path, reference_run: Path, tmp_path: Path) -> None:
    # Not just after a storage save (its background write settles first) nor in the step after a memory save
    # (whose write may not be committed yet): a kill in step S redoes the steps since the newest memory step.
    step = random.choice([s for s in range(13, 40) if s % 10 >= 3 and s % 5 != 1])
    run_dir = tmp_path / "killed"
    args = ["train", "--nproc", "2", "--max-restarts", "1", "--run-dir", str(run_dir), *SMALL_RUN,
            "train.steps=40", f"data.dir={small_corpus}", "checkpoint.interval=10", "checkpoint.keep_last=10",
            "checkpoint.memory_interval=5", f'drill.inject=["kill:step={step},rank=1"]']
    memory = memory_root("", run_dir)
    with (tmp_path / "out.log").open("w") as out, (tmp_path / "err.log").open("w") as err:
        proc, tag = spawn_keel(args, tmp_path, text=True, stdout=out, stderr=err)
    watch = None
    try:
        events_log = run_dir / "events.jsonl"
        _wait_for(events_log, lambda r: r["kind"] == "drill" and r["action"] == "inject")
        before = len(read_jsonl(events_log))
        stored = sorted(p for p in (run_dir / "checkpoints").glob("step-*") if (p / "manifest.json").exists())
        watch = Watch(events_log, stored)
        resumed_at, resumed = _wait_for(events_log, lambda r: r["kind"] == "resume")
        assert proc.wait(timeout=180) == 0, (tmp_path / "err.log").read_text()[-3000:]
    finally:
        if watch is not None:
            watch.close()
        kill_tagged(tag)
    newest = (step - 1) // 5 * 5
    assert [int(p.name.removeprefix("step-")) for p in stored] == list(range(10, step, 10)), "storage had its own"
    assert watch.opened_before_record(resumed_at - before + 1) == [], "the restore read the checkpoint storage"
    (restored,) = [r for r in read_jsonl(run_dir / "events.jsonl") if r["kind"] == "memory" and
                   r["action"] == "restored"]
    assert (restored["step"], resumed["step"]) == (newest, newest), f"killed in step {step}"
    assert restored["path"] == f"{memory}/step-{newest:06d}" and step - newest <= 5
    assert state_sha256(run_dir / "checkpoints" / "step-000040") == \
        state_sha256(reference_run / "checkpoints" / "step-000040"), f"killed in step {step}"
    assert not memory.exists(), "the launcher removes the memory tier when the job ends"
    restarts = [r for r in read_jsonl(run_dir / "events.jsonl") if r["kind"] == "failure"]
    assert [r["action"] for r in restarts] == ["restart"], json.dumps(restarts)
