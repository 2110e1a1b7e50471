"""bench/memory_tier.py's cost of the tier within one run, on a run's records whose step times are set by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.memory_tier import cycle_cost


def write_steps(run_dir: Path, times: dict[int, float]) -> Path:
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "time/step_s": t}) + "\n"
                                                   for s, t in times.items()))
    return run_dir


def test_the_steps_beside_a_write_are_set_against_the_rest_of_their_cycle(tmp_path: Path) -> None:
    # Saves every 5 steps, a write of 6 s beside 5 s steps: the two steps after each save are slower (1.0 and
    # 0.2 s), the saving step itself faster, which is left out; the first cycle (start-up) too.
    extra = {0: -0.4, 1: 1.0, 2: 0.2, 3: 0.0, 4: 0.0}
    times = {s: (50.0 if s <= 5 else 5.0 + extra[s % 5]) for s in range(1, 41)}
    assert cycle_cost(write_steps(tmp_path / "run", times), 5, 6.0) == pytest.approx(1.2 / 25)


def test_a_write_that_reaches_every_step_of_its_cycle_gives_no_estimate(tmp_path: Path) -> None:
    times = {s: 5.0 for s in range(1, 21)}
    assert cycle_cost(write_steps(tmp_path / "run", times), 5, 30.0) is None
    assert cycle_cost(write_steps(tmp_path / "short", {1: 5.0, 2: 5.0}), 5, 1.0) is None
