"""`keel drill` rejects what it cannot run with one line and exit code 2, before any run starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from keel.cli import main
from keel.drill.scenarios import catalog


@pytest.mark.parametrize("args, expect", [
    (["--scenario", "kill_mid_step,meteor"], "--scenario meteor: no such scenario; expected one of kill_mid_step"),
    (["train.steps=5"], "'train.steps=5': the drill sets train.steps, checkpoint.interval"),
    (["--steps", "20", "--interval", "10"], "--steps 20 --interval 10: a drill needs an interval of at least 2 and "
                                            "at least three checkpoints"),
    (["--config", "missing.toml"], "--config 'missing.toml' does not exist"),
    (["--chaos", "--mtbf", "soon"], "--mtbf"),
])
def test_bad_drill_input_is_one_line_and_exit_2(args: list[str], expect: str, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["drill", "--workdir", str(tmp_path / "drill"), *args]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("keel: error:") and expect in lines[0], lines
    assert not (tmp_path / "drill" / "references").exists(), "nothing ran"


def test_the_catalog_is_listed_with_each_promise(capsys: pytest.CaptureFixture) -> None:
    assert main(["drill", "--list"]) == 0
    out = capsys.readouterr().out
    for scenario in catalog().values():
        assert f"{scenario.name} " in out and scenario.promise in out
