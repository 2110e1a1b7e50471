"""bench/nonstop_recovery.py's accounting of a failure's cost, on step records whose cost is known by hand."""

from __future__ import annotations

import pytest

from bench.nonstop_recovery import account, step_records


def timeline(*spans: tuple[range, float], start: float = 0.0) -> list[tuple[int, float]]:
    """(step, time) records: each range of steps at its own seconds per step, one after the other."""
    out, t = [], start
    for steps, seconds in spans:
        for step in steps:
            t += seconds
            out.append((step, t))
    return out


def test_a_lost_group_costs_its_downtime_and_the_survivors_stall() -> None:
    # 2 processes, 1 s steps; the kill lands in step 11; the survivor stalls 0.5 s, then makes steps 11-13 alone
    # at 2 s each (it reads the missing group's share); the healed group is back for step 14.
    steps = timeline((range(1, 11), 1.0), (range(11, 12), 2.5), (range(12, 14), 2.0), (range(14, 20), 1.0))
    got = account(steps, killed=10.5, healed=17.5, nproc=2, ckpt_every=100)
    assert got["pace_s"] == 1.0
    assert got["longest_over_pace_s"] == 1.5
    # dead: 10 → 16.5 (6.5 s, while the survivor did its share), survivor: the 0.5 s stall
    assert got["lost_accelerator_s"] == pytest.approx(7.0)


def test_a_restart_costs_every_process_its_outage_and_the_steps_made_again() -> None:
    # 2 processes, 1 s steps, a checkpoint at step 10; the kill lands in step 16; every worker is back 10 s
    # after step 15 and makes steps 11-15 again: at t = 28 the job is at step 14, a fault-free one at 28.
    steps = timeline((range(1, 16), 1.0), (range(11, 12), 10.0), (range(12, 20), 1.0))
    got = account(steps, killed=15.5, healed=25.0, nproc=2, ckpt_every=10)
    assert got["longest_step_s"] == 10.0
    assert got["progress_steps"] == -1
    assert got["lost_accelerator_s"] == pytest.approx(2 * 14.0)


def test_a_checkpoint_after_the_kill_costs_only_what_it_costs_without_one() -> None:
    # Checkpoint steps take 3 s where the others take 1; one falls inside the recovery window.
    steps, t = [], 0.0
    for step in range(1, 25):
        t += 3.0 if step % 5 == 0 else (2.5 if step == 12 else 1.0)
        steps.append((step, t))
    got = account(steps, killed=steps[10][1] + 0.5, healed=steps[14][1], nproc=1, ckpt_every=5)
    assert got["save_s"] == 2.0
    assert got["longest_over_pace_s"] == 1.5  # the stalled step 12, not the checkpoint at step 15
    assert got["lost_accelerator_s"] == pytest.approx(1.5)


def test_validation_records_are_not_steps() -> None:
    metrics = [{"step": 1, "time": 1.0, "train/loss": 5.0}, {"step": 1, "val/loss": 5.1},
               {"step": 2, "time": 2.0, "train/loss": 4.0}]
    assert step_records(metrics) == [(1, 1.0), (2, 2.0)]
