"""The coordinate check: under μP every block's output RMS stays put as the width grows; under the standard
parametrization it grows. `keel sweep --coord-check` writes the readings and the page, and refuses bad input
in one line before it trains anything."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from keel.config import load_config
from keel.errors import ConfigError
from keel.sweep.coord_check import coord_check, parse_multipliers
from tests.conftest import run_keel

SHAPE = ["model.dim=32", "model.n_heads=4", "model.n_kv_heads=2", "model.n_layers=2", "train.seq_len=32"]


def test_mup_keeps_every_block_flat_across_widths_and_sp_does_not() -> None:
    check = coord_check(load_config(None, SHAPE), [1, 2, 4, 8], steps=3, batch=2, device=torch.device("cpu"),
                        say=lambda line: None)
    assert check.layers == ["embedding", "block 0", "block 1", "logits"]
    assert check.growth("mup", 3) <= 1.5
    assert check.growth("sp", 3) >= 3 * check.growth("mup", 3)
    # Every width saw the same tokens from the same seed: at initialisation the embeddings are the same draw.
    first = [check.rms["mup"][k][0][0] for k in (1, 2, 4, 8)]
    assert max(first) / min(first) < 1.1


@pytest.mark.parametrize("text", ["8,4", "1", "0,2", "1,x", "2,2"])
def test_widths_must_be_at_least_two_increasing_multipliers(text: str) -> None:
    with pytest.raises(ConfigError, match="--widths"):
        parse_multipliers(text)


def test_the_command_writes_the_readings_and_the_page(tmp_path: Path) -> None:
    out = tmp_path / "cc"
    result = run_keel(["sweep", "--coord-check", *SHAPE, "--widths", "1,4", "--steps", "2", "--out", str(out)],
                      cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr
    record = json.loads((out / "coord_check.json").read_text())
    assert record["multipliers"] == [1, 4] and set(record["growth"]) == {"sp", "mup"}
    assert record["growth"]["mup"][1] <= 1.5 < record["growth"]["sp"][1]
    page = (out / "coord_check.html").read_text()
    assert page.count("<svg") == 4 and "mup, step 2: output RMS over the base width" in page
    assert "mup: block RMS at x4 over x1" in result.stdout


@pytest.mark.parametrize(("args", "expect"), [
    (["--widths", "4,1"], "--widths"),
    (["--grid", "optim.lr=1e-3,1e-2"], "leave out --grid"),
    (["model.tie_embeddings=true"], "model.tie_embeddings = false"),
])
def test_bad_requests_are_one_line_and_write_nothing(tmp_path: Path, args: list[str], expect: str) -> None:
    result = run_keel(["sweep", "--coord-check", *SHAPE, *args, "--out", str(tmp_path / "cc")], cwd=tmp_path,
                      timeout=60)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1 and expect in result.stderr
    assert not (tmp_path / "cc").exists()
