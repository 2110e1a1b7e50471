"""A sweep's grid: log-spaced ranges and lists, every point checked as a whole config before anything trains,
and each kind of bad grid refused in one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from keel.errors import ConfigError
from keel.sweep.grid import expand, parse_axis, parse_grid, point_configs
from tests.conftest import run_keel


def test_a_range_is_log_spaced_with_both_ends() -> None:
    assert parse_axis("optim.lr=1e-4..1e-2:3").values == ("0.0001", "0.001", "0.01")
    assert parse_axis("model.dim=64..512:4").values == ("64", "128", "256", "512")
    assert parse_axis("optim.lr=3e-3..3e-3:1").values == ("0.003",)


def test_a_list_keeps_its_values_as_written() -> None:
    assert parse_axis("model.parametrization=sp,mup").values == ("sp", "mup")


def test_points_are_every_combination_in_axis_order_with_stable_names() -> None:
    points = expand([parse_axis("optim.lr=1e-3,1e-2"), parse_axis("model.dim=32,64")])
    assert [p.overrides for p in points] == [["optim.lr=1e-3", "model.dim=32"], ["optim.lr=1e-3", "model.dim=64"],
                                             ["optim.lr=1e-2", "model.dim=32"], ["optim.lr=1e-2", "model.dim=64"]]
    assert [p.name for p in points] == ["000-lr1e-3-dim32", "001-lr1e-3-dim64", "002-lr1e-2-dim32",
                                        "003-lr1e-2-dim64"]


@pytest.mark.parametrize(("spec", "expect"), [
    ("optim.lr=", "expected KEY=LO..HI:N"),
    ("optim.lr=1e-2..1e-4:3", "0 < LO < HI"),
    ("optim.lr=0..1e-2:3", "0 < LO < HI"),
    ("optim.lr=1e-4..1e-2:0", "positive integer"),
    ("optim.lr=1e-4..1e-2", "needs its count"),
    ("optim.lr=1e-4..x:3", "not a number"),
    ("model.dim=64..70:8", "repeat"),
    ("model.dim=64,,128", "empty value"),
    ("model.dim=64,64", "listed twice"),
    ("train.steps=10,20", "--steps"),
])
def test_bad_axes_are_one_line(spec: str, expect: str) -> None:
    with pytest.raises(ConfigError, match=expect) as e:
        parse_axis(spec)
    assert "\n" not in str(e.value)


def test_an_axis_given_twice_or_also_as_an_override_is_refused() -> None:
    with pytest.raises(ConfigError, match="given twice"):
        parse_grid(["optim.lr=1e-3", "optim.lr=1e-2"], [])
    with pytest.raises(ConfigError, match="both an override and a --grid axis"):
        parse_grid(["optim.lr=1e-3,1e-2"], ["optim.lr=1e-3"])
    with pytest.raises(ConfigError, match="at least one --grid"):
        parse_grid([], [])


@pytest.mark.parametrize(("spec", "expect"), [
    ("optim.lr=-1,1e-3", "optim.lr = -1.0 is out of range"),
    ("model.dimension=32,64", "unknown config key 'dimension'"),
    ("model.dim=30,64", "must divide by model.n_heads"),
])
def test_a_point_whose_config_is_bad_is_named(spec: str, expect: str) -> None:
    with pytest.raises(ConfigError, match=expect) as e:
        point_configs(None, [], expand([parse_axis(spec)]))
    assert str(e.value).startswith("sweep point ")


@pytest.mark.parametrize(("grid", "expect"), [
    ("optim.lr=1e-2..1e-4:4", "0 < LO < HI"),
    ("model.width=32,64", "unknown config key 'width'"),
    ("optim.lr=1e-3,-1e-3", "is out of range"),
])
def test_the_command_refuses_a_bad_grid_in_one_line_before_any_point_runs(tmp_path: Path, grid: str,
                                                                          expect: str) -> None:
    out = tmp_path / "sweep"
    result = run_keel(["sweep", "--grid", grid, "--grid", "model.dim=32,64", "--out", str(out)], cwd=tmp_path,
                      timeout=60)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1 and expect in result.stderr
    assert not out.exists()
