"""The health commands (`keel pause`, `keel status`, an elastic `keel train`) refuse bad input with one line
and exit code 2, and a quarantined node does not rejoin."""

from __future__ import annotations

from pathlib import Path

import pytest

from keel.rundir.quarantine import add_to_quarantine
from tests.conftest import run_keel


@pytest.mark.parametrize("args, expect", [
    (["pause", "{tmp}"], "no keel job is running in"),
    (["status", "{tmp}/missing"], "does not exist"),
    (["train", "--nnodes", "2:1", "--rdzv-endpoint", "localhost:29400", "--run-dir", "{tmp}/r"],
     "--nnodes '2:1': expected MIN:MAX"),
    (["train", "--nnodes", "1:2", "--run-dir", "{tmp}/r"], "needs HOST:PORT of the rendezvous"),
    (["train", "--local-addr", "10.0.0.2", "--run-dir", "{tmp}/r"], "a node's address is for an elastic job"),
])
def test_health_commands_refuse_bad_input_with_one_line(args: list[str], expect: str, tmp_path: Path) -> None:
    result = run_keel([a.format(tmp=tmp_path) for a in args], cwd=tmp_path, timeout=60)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and expect in lines[0], result.stderr


def test_a_quarantined_node_does_not_rejoin(tmp_path: Path) -> None:
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    add_to_quarantine(run_dir, ["n1"], source="keel quarantine", reason="bad")
    result = run_keel(["train", "--nnodes", "1:2", "--rdzv-endpoint", "localhost:29400", "--run-dir", str(run_dir)],
                      cwd=tmp_path, timeout=60, env={"KEEL_NODE": "n1"})
    assert result.returncode == 2 and "node n1 is listed in" in result.stderr, result.stderr
    assert "--release" in result.stderr


@pytest.mark.parametrize(("overrides", "nnodes", "why"), [
    ([], "1", ""),
    ([], "1:2", "this job spans nodes"),
    (["fault_tolerance.replica_groups=2"], "1", "its replica groups heal a group from a live one instead"),
])
def test_in_process_restarts_are_made_where_they_can_be_and_said_where_not(
        overrides: list[str], nnodes: str, why: str, capsys: pytest.CaptureFixture[str]) -> None:
    from keel.cli.train import in_process_restarts
    from keel.config import load_config

    cfg = load_config(None, ["health.in_process_restart=true", "train.device=cpu", *overrides])
    assert in_process_restarts(cfg, nnodes) == (not why)
    said = capsys.readouterr().out
    assert (why in said and "a killed worker restarts every worker" in said) if why else said == ""
    assert not in_process_restarts(load_config(None, []), "1"), "off by default"
