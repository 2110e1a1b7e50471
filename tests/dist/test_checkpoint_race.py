"""A replica group's worker that starts while another group's background save is in flight, in the one
checkpoint directory they share: it leaves that save alone, and nothing is ever committed without the
tensors DCP loads."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from keel.checkpoint.inspect import load_full_state
from keel.checkpoint.manifest import committed, verify
from keel.checkpoint.storage import Storage
from keel.core.replica import GROUP_ENV
from keel.rundir.events import host, read_jsonl
from tests.conftest import keel_env, run_keel

pytestmark = pytest.mark.dist

PROBE = [sys.executable, "-m", "tests.dist.checkpoint_race_probe"]
SEED, MOMENTS = 41, 20


def test_a_group_starting_during_another_groups_background_saves_never_costs_a_checkpoint_its_tensors(
        tmp_path: Path) -> None:
    root, stop, out = tmp_path / "checkpoints", tmp_path / "stop", tmp_path / "outcomes.json"
    (tmp_path / "groups" / "0").mkdir(parents=True)
    (tmp_path / "groups" / "1").mkdir(parents=True)
    writer = subprocess.Popen([*PROBE, "writer", str(root), str(tmp_path / "groups" / "0"), str(stop), str(out)],
                              env={**keel_env(), GROUP_ENV: "0"}, stderr=subprocess.PIPE, text=True)
    try:
        starter = subprocess.run([*PROBE, "starter", str(root), str(tmp_path / "groups" / "1"), str(SEED),
                                  str(MOMENTS)], env={**keel_env(), GROUP_ENV: "1"}, capture_output=True, text=True,
                                 timeout=600)
        stop.touch()
        _, err = writer.communicate(timeout=120)
    finally:
        writer.kill()
        writer.wait()
    assert starter.returncode == 0, starter.stderr[-3000:]
    assert writer.returncode == 0, err[-3000:]

    # The starts met saves in flight, left each to its writer and removed nothing.
    seen = [e for e in read_jsonl(tmp_path / "groups" / "1" / "events.jsonl") if e["kind"] == "checkpoint"]
    assert {e["action"] for e in seen} <= {"left"}
    assert seen and all(e["detail"]["reason"] == f"being written by pid {writer.pid} on {host()}, replica group 0"
                        for e in seen)

    # Every save was committed, and every committed checkpoint verifies and loads with DCP, its own tensors.
    outcomes = json.loads(out.read_text())
    assert [o for o in outcomes if not o["committed"]] == []
    storage = Storage(root)
    assert committed(storage) == [f"step-{o['step']:06d}" for o in outcomes]
    for o in outcomes:
        name = f"step-{o['step']:06d}"
        assert verify(storage, name) == [], name
        state = load_full_state(root / name)
        assert state["model.weight"].eq(o["step"]).all() and state["model.bias"].eq(o["step"]).all(), name
    assert not list(root.glob("*.tmp"))

    # A checkpoint that loses its .metadata or a data file afterwards fails `keel ckpt verify`, naming it.
    names = committed(storage)
    (root / names[0] / ".metadata").unlink()
    (root / names[1] / "__0_0.distcp").unlink()
    checked = run_keel(["ckpt", "verify", str(root)], cwd=tmp_path)
    assert checked.returncode == 2 and f"2 of {len(names)} checkpoints" in checked.stderr
    failed = [line for line in checked.stdout.splitlines() if "FAILED" in line]
    assert failed == [f"{root / names[0]}: FAILED: .metadata is missing",
                      f"{root / names[1]}: FAILED: __0_0.distcp is missing"]
