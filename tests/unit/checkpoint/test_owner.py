"""Who owns an unfinished save: a start removes only what a writer proven gone left, and leaves what a live
process (the writer of another replica group, another job) is writing, whatever it finds there."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from keel.checkpoint import owner
from keel.checkpoint.storage import Storage
from keel.rundir.events import host
from tests.conftest import keel_env, tmpfs
from tests.unit.checkpoint.test_manager import Run, hashes

# A writer in a process of its own: it claims a save's staging name, writes a file there and says so; with
# `--let-go` it then drops the lock but keeps running (a file system whose locks other processes do not see).
WRITER = textwrap.dedent("""
    import os, sys, time
    from keel.checkpoint import owner
    from keel.checkpoint.storage import Storage
    storage = Storage(sys.argv[1])
    claim = owner.claim(storage, sys.argv[2], "elsewhere")
    storage.makedirs(sys.argv[2])
    storage.write_durably(sys.argv[2] + "/__0_0.distcp", b"tensors being written")
    if "--let-go" in sys.argv:
        os.close(claim.fd)
    print("ready", flush=True)
    time.sleep(600)
""")


@pytest.fixture
def writers() -> Iterator[list[subprocess.Popen]]:
    started: list[subprocess.Popen] = []
    yield started
    for proc in started:
        proc.kill()
        proc.wait()


def start_writer(writers: list[subprocess.Popen], root: Path, name: str, *flags: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(root), name, *flags], env=keel_env(),
                            stdout=subprocess.PIPE, text=True)
    writers.append(proc)
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    return proc


def killed(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return proc.pid


def checkpoint_events(run: Run, action: str) -> dict[str, str]:
    return {Path(e["detail"]["path"]).name: e["detail"]["reason"] for e in run.events(action)}


def test_a_start_leaves_the_save_of_a_live_writer_and_removes_the_one_of_a_writer_that_died(
        tmp_path: Path, group: None, writers: list[subprocess.Popen]) -> None:
    root = tmp_path / "ckpt"
    live = start_writer(writers, root, "step-000020.tmp")
    dead = killed(start_writer(writers, root, "step-000030.tmp"))
    unlocked = start_writer(writers, root, "step-000040.tmp", "--let-go")
    before = hashes(root)
    run = Run(tmp_path, root)
    assert sorted(p.name for p in root.iterdir() if p.name != ".locks") == ["step-000020.tmp", "step-000040.tmp"]
    assert hashes(root) == {k: v for k, v in before.items() if not k.startswith("step-000030.tmp")}
    left = checkpoint_events(run, "left")
    assert left == {"step-000020.tmp": f"being written by pid {live.pid} on {host()}",
                    "step-000040.tmp": f"being written by pid {unlocked.pid} on {host()}"}
    assert checkpoint_events(run, "cleaned") == {
        "step-000030.tmp": f"left unfinished by an interrupted save: its writer, pid {dead} on "
                           f"{host()}, has ended"}
    assert not (root / ".locks" / "step-000030.tmp").exists()


def test_a_save_of_a_step_another_live_writer_is_writing_fails_and_leaves_it(
        tmp_path: Path, group: None, writers: list[subprocess.Popen]) -> None:
    root = tmp_path / "ckpt"
    run = Run(tmp_path, root)
    start_writer(writers, root, "step-000020.tmp")
    before = hashes(root)
    outcome = run.save(20)
    assert not outcome.committed
    assert f"{root / 'step-000020.tmp'} is being written by another process; this save is skipped" in outcome.error
    assert hashes(root) == before and not (root / "step-000020").exists()
    assert run.save(30).committed, "the next save goes on as usual"


def test_a_save_of_a_step_whose_writer_died_replaces_what_it_left(
        tmp_path: Path, group: None, writers: list[subprocess.Popen]) -> None:
    root = tmp_path / "ckpt"
    run = Run(tmp_path, root)
    killed(start_writer(writers, root, "step-000020.tmp"))
    assert run.save(20).committed
    assert sorted(p.name for p in root.iterdir()) == [".locks", "latest", "step-000020"]
    assert list((root / ".locks").iterdir()) == [], "a save's claim goes with it"


def test_a_save_from_another_machine_is_left_until_it_has_been_untouched_for_the_bound(
        tmp_path: Path, group: None) -> None:
    root = tmp_path / "ckpt"
    storage = Storage(root)
    storage.makedirs("step-000020.tmp")
    storage.write_durably("step-000020.tmp/__0_0.distcp", b"tensors")
    record = {**owner.writer_record("elsewhere"), "boot": "another machine", "host": "node7"}
    lock = Path(storage.path(storage.lock_name("step-000020.tmp")))
    lock.write_text(json.dumps(record))
    Run(tmp_path, root)
    assert (root / "step-000020.tmp" / "__0_0.distcp").exists()
    old = time.time() - owner.ABANDONED_AFTER_S - 60
    record["since"] = old
    lock.write_text(json.dumps(record))
    for path in (root / "step-000020.tmp", root / "step-000020.tmp" / "__0_0.distcp"):
        os.utime(path, (old, old))
    run = Run(tmp_path, root)
    assert not (root / "step-000020.tmp").exists()
    reason = checkpoint_events(run, "cleaned")["step-000020.tmp"]
    assert reason.startswith("left unfinished by an interrupted save: untouched for ") and "node7" in reason
    assert "node7, a process this machine cannot see, changed " in checkpoint_events(run, "left")["step-000020.tmp"]


@pytest.mark.parametrize("record", [b"", b'{"pid": 12', b'{"pid": "12", "boot": 3}'])
def test_a_save_whose_writer_left_no_record_that_reads_is_kept_while_it_is_recent(
        tmp_path: Path, group: None, record: bytes) -> None:
    root = tmp_path / "ckpt"
    storage = Storage(root)
    storage.makedirs("step-000020.tmp")
    Path(storage.path(storage.lock_name("step-000020.tmp"))).write_bytes(record)
    run = Run(tmp_path, root)
    assert (root / "step-000020.tmp").is_dir()
    assert checkpoint_events(run, "left")["step-000020.tmp"].startswith("its writer unknown, changed ")


def test_a_leftover_that_cannot_be_removed_is_reported_and_the_start_goes_on(
        tmp_path: Path, group: None, writers: list[subprocess.Popen]) -> None:
    root = tmp_path / "ckpt"
    killed(start_writer(writers, root, "step-000020.tmp"))
    with tmpfs(root / "step-000020.tmp" / "mounted", "1m"):  # rmdir of a mount point: EBUSY
        run = Run(tmp_path, root)
        reason = checkpoint_events(run, "left")["step-000020.tmp"]
        assert reason.startswith("it could not be removed (OSError: [Errno 16] Device or resource busy")
        assert run.save(30).committed


def test_the_old_copy_of_a_step_being_saved_again_is_left_to_its_writer(
        tmp_path: Path, group: None, writers: list[subprocess.Popen]) -> None:
    root = tmp_path / "ckpt"
    writer = start_writer(writers, root, "step-000020.tmp")
    (root / "step-000020.replaced").mkdir()  # the writer swaps it with its new copy
    Run(tmp_path, root)
    assert (root / "step-000020.replaced").is_dir() and not (root / "step-000020").exists()
    killed(writer)  # interrupted before the new copy was in place: the next start puts the old one back
    Run(tmp_path, root)
    assert (root / "step-000020").is_dir() and not (root / "step-000020.replaced").exists()
