"""Runs side by side: `keel report RUN_A RUN_B` overlays two real runs' curves and lists the config keys they
differ in; `keel runs DIR` lists every run directory under DIR with its state, step, losses and goodput; bad
arguments are one line and exit code 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import SMALL_RUN, run_keel


@pytest.fixture(scope="module")
def two_runs(small_corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("compare") / "runs"
    for name, lr in (("a", "1e-3"), ("b", "3e-3")):
        result = run_keel(["train", "--run-dir", str(root / name), *SMALL_RUN, f"data.dir={small_corpus}",
                           "train.steps=10", "eval.interval=5", f"optim.lr={lr}"], cwd=root.parent, timeout=180)
        assert result.returncode == 0, result.stderr[-3000:]
    return root


def test_the_comparison_overlays_both_runs_and_lists_what_their_configs_differ_in(two_runs: Path) -> None:
    out = two_runs.parent / "compare.html"
    result = run_keel(["report", str(two_runs / "a"), str(two_runs / "b"), "--out", str(out)], cwd=two_runs.parent)
    assert result.returncode == 0, result.stderr
    page = out.read_text()
    assert page.count("<svg") == 6  # loss, validation loss, learning rate, gradient norm, throughput, goodput
    assert page.count('data-name="a"') >= 6 and page.count('data-name="b"') >= 6  # each run on every chart
    assert "<tr><td>optim.lr</td><td>0.001</td><td>0.003</td></tr>" in page
    assert "<td>model.dim</td>" not in page  # the same in both: not a difference


def test_runs_lists_every_run_directory_with_its_state_and_losses(two_runs: Path) -> None:
    result = run_keel(["runs", str(two_runs), "--json"], cwd=two_runs.parent)
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    assert [Path(r["run_dir"]).name for r in rows] == ["a", "b"]
    for row in rows:
        summary = json.loads((Path(row["run_dir"]) / "summary.json").read_text())
        assert (row["state"], row["step"], row["total_steps"]) == ("finished", 10, 10)
        assert (row["train_loss"], row["val_loss"]) == (summary["train_loss"], summary["val_loss"])
        assert 0 < row["goodput"] <= 1
    table = run_keel(["runs", str(two_runs)], cwd=two_runs.parent).stdout.splitlines()
    assert table[0].split()[:3] == ["run", "state", "step"] and table[1].startswith("a ") and "10/10" in table[1]


@pytest.mark.parametrize(("args", "expect"), [
    (["report", "{runs}/a", "{runs}"], "is not a keel run directory"),
    (["report", "{runs}/a", "{runs}/a"], "given twice"),
    (["runs", "{runs}/missing"], "does not exist"),
])
def test_bad_arguments_are_one_line(two_runs: Path, args: list[str], expect: str) -> None:
    result = run_keel([a.format(runs=two_runs) for a in args], cwd=two_runs.parent)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1 and expect in result.stderr
