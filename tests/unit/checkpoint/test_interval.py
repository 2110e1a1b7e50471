"""The checkpoint interval: Daly's formula against the optimum of his own cost model, and the policies."""

from __future__ import annotations

import math

import numpy as np
import pytest

from keel.checkpoint.interval import IntervalPolicy, daly_interval
from keel.config import CheckpointConfig


def daly_expected_time(tau: float, delta: float, mtbf: float, restart: float = 0.0) -> float:
    """Daly 2006, eq. (13): expected wall time per unit of solve time with checkpoints every tau."""
    return mtbf * math.exp(restart / mtbf) * (math.exp((tau + delta) / mtbf) - 1) / tau


@pytest.mark.parametrize(("delta", "mtbf"), [(5.0, 3600.0), (60.0, 86400.0), (300.0, 4 * 3600.0), (1.0, 50.0)])
def test_daly_interval_is_the_optimum_of_the_exponential_failure_model(delta: float, mtbf: float) -> None:
    taus = np.geomspace(delta / 100, 10 * mtbf, 200_000)
    cost = mtbf * (np.exp((taus + delta) / mtbf) - 1) / taus
    best = float(taus[np.argmin(cost)])
    tau = daly_interval(delta, mtbf)
    assert math.isclose(tau, best, rel_tol=0.02), (tau, best)
    assert daly_expected_time(tau, delta, mtbf) <= daly_expected_time(best, delta, mtbf) * 1.0001
    young = math.sqrt(2 * delta * mtbf)
    assert abs(tau - best) <= abs(young - best) + 1e-9, "Daly's correction improves on Young's first order"


def test_daly_interval_when_a_checkpoint_costs_more_than_twice_the_mtbf() -> None:
    assert daly_interval(100.0, 40.0) == 40.0


def test_step_policy_saves_every_interval_steps() -> None:
    policy = IntervalPolicy(CheckpointConfig(policy="steps", interval=25))
    assert [s for s in range(1, 101) if policy.due_by_step(s)] == [25, 50, 75, 100]
    assert not policy.due_by_time(1e9)
    assert policy.update(1.0, 100.0, 0) is None


def test_seconds_policy_saves_by_time_only() -> None:
    policy = IntervalPolicy(CheckpointConfig(policy="seconds", every_seconds=90, interval=10))
    assert not any(policy.due_by_step(s) for s in range(1, 100))
    assert not policy.due_by_time(89.9) and policy.due_by_time(90.0)


def test_auto_policy_measures_first_then_follows_daly() -> None:
    policy = IntervalPolicy(CheckpointConfig(policy="auto", interval=50, mtbf_hours=2.0))
    assert policy.due_by_step(50) and not policy.due_by_step(49)
    decision = policy.update(blocking_s=4.0, train_s=100.0, interruptions=0)
    assert decision["mtbf_source"] == "checkpoint.mtbf_hours" and decision["mtbf_s"] == 7200.0
    assert math.isclose(decision["interval_s"], daly_interval(4.0, 7200.0), rel_tol=1e-3)
    assert not policy.due_by_step(100), "after the first measurement, time decides"
    assert policy.due_by_time(daly_interval(4.0, 7200.0) + 0.01)
    observed = policy.update(blocking_s=4.0, train_s=3000.0, interruptions=3)
    assert observed["mtbf_s"] == 1000.0 and "observed" in observed["mtbf_source"]
    assert observed["interval_s"] < decision["interval_s"], "more failures, more frequent checkpoints"
