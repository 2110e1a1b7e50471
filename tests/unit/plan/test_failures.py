"""Failure model, checkpoint cost, Young/Daly, the Monte Carlo of a run, and cost: against formulas and Llama 3."""

from __future__ import annotations

import math
import time
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keel.checkpoint.interval import daly_interval
from keel.errors import KeelError
from keel.plan.cost import DEFAULT_PRICE_PER_HOUR, cost, cost_of, expected_cost, money_percentiles
from keel.plan.failures import (
    DEFAULT_DEVICE_MTBF_H,
    DEFAULT_MEMORY_COVERAGE,
    LLAMA3_DAYS,
    LLAMA3_GPUS,
    LLAMA3_INTERRUPTIONS,
    FailureMix,
    FailureModel,
    Policy,
    Recovery,
    Run,
    Storage,
    _intervals_done,
    _wall_of,
    checkpoint_bytes,
    compare_policies,
    down_time,
    effective_ratio,
    expected_goodput,
    first_order_waste,
    memory_save_times,
    replication,
    restore_time,
    save_times,
    schedule,
    simulate,
    tiers,
    two_tier_waste,
    young_daly,
    young_daly_tiers,
)

FAST = settings(max_examples=25, deadline=None, derandomize=True)


def llama3_run() -> tuple[Run, Policy]:
    """Llama 3 405B pre-training (arXiv 2407.21783 §3.3.4) as far as it is published, plus stated assumptions.

    Checkpoint: 405e9 params × 14 bytes (fp32 master, m, v + bf16 weights) + 1 MiB per rank = 5.69 TB, 347 MB per
    GPU on average, inside their published 1 MB-4 GB per GPU. Storage 2 TB/s sustained (published): a synchronous
    save blocks 2.8 s + 1 s of overhead. Interval: not published; 10 min is assumed, a round figure above the
    Young/Daly optimum for δ = 3.8 s and M = 3.1 h (4.8 min), so the check does not rely on a tuned interval.
    Recovery (not published): 2 min to detect, 5 min to relaunch 16k ranks on a spare node, 2.8 s to read the
    checkpoint back; the > 90% conclusion holds up to ~12 min of total down time per failure at this interval.
    The work is sized so that the expected wall time is their 54 days.
    """
    policy = Policy(name="llama3", async_save=False, interval_s=600.0, restore="disk", spare_nodes=16)
    size = checkpoint_bytes(405e9, LLAMA3_GPUS)
    probe = Run(work_s=LLAMA3_DAYS * 86400, devices=LLAMA3_GPUS, ckpt_bytes=size)
    return Run(work_s=LLAMA3_DAYS * 86400 * effective_ratio(probe, policy), devices=LLAMA3_GPUS,
               ckpt_bytes=size), policy


def small_run(mtbf_h: float = 24.0, work_days: float = 60.0, **storage) -> Run:
    """One device with the given MTBF, a 4 GB checkpoint on 1 GB/s storage: δ = 5 s synchronous."""
    return Run(work_s=work_days * 86400, devices=1, ckpt_bytes=4e9,
               failures=FailureModel(device_mtbf_h=mtbf_h, hardware_fraction=0.0),
               storage=Storage(write_bw=1e9, save_overhead_s=1.0, **storage),
               recovery=Recovery(detect_s=10.0, restart_s=20.0, repair_s=3600.0))


def test_default_mtbf_is_derived_from_llama3_and_shrinks_with_scale() -> None:
    assert round(DEFAULT_DEVICE_MTBF_H) == round(16_384 * 54 * 24 / 419) == 50_677
    fm = FailureModel()
    assert fm.job_mtbf_s(LLAMA3_GPUS) / 3600 == pytest.approx(LLAMA3_DAYS * 24 / LLAMA3_INTERRUPTIONS)
    assert fm.job_mtbf_s(1024) == pytest.approx(16 * fm.job_mtbf_s(LLAMA3_GPUS))
    with_nodes = FailureModel(node_mtbf_h=100_000.0)
    expected = 3600 / (1024 / DEFAULT_DEVICE_MTBF_H + 128 / 100_000.0)
    assert with_nodes.job_mtbf_s(1024) == pytest.approx(expected)
    assert expected < fm.job_mtbf_s(1024)
    with pytest.raises(KeelError, match="weibull"):
        FailureModel(dist="gamma")


def test_checkpoint_size_and_save_and_restore_times() -> None:
    assert checkpoint_bytes(1e9, 8, bf16_weights=False, extra_per_rank=0) == 12e9
    assert checkpoint_bytes(1e9, 8, extra_per_rank=1e6) == 14e9 + 8e6
    run = Run(work_s=1.0, devices=1000, ckpt_bytes=10e12,
              storage=Storage(write_bw=1e12, host_copy_bw=20e9, peer_bw=50e9, save_overhead_s=0.5))
    assert save_times(run, async_save=False) == pytest.approx((10.5, 0.0))  # blocks for size / bandwidth
    assert save_times(run, async_save=True) == pytest.approx((0.5 + 10e9 / 20e9, 10.0))  # copy, then writes
    assert restore_time(run, "disk") == pytest.approx(10.0)
    assert restore_time(run, "memory") == pytest.approx(10e9 / 50e9)


def test_young_daly_reuses_daly_interval_and_async_never_outruns_its_write() -> None:
    run = small_run()
    assert young_daly(run, async_save=False) == pytest.approx(daly_interval(5.0, 86400.0))
    slow = Run(work_s=1.0, devices=1, ckpt_bytes=1e12, failures=FailureModel(device_mtbf_h=1.0),
               storage=Storage(write_bw=1e9, host_copy_bw=1e12))
    assert daly_interval(2.0, 3600.0) < 1000
    assert young_daly(slow, async_save=True) == pytest.approx(1000.0), "the 1000 s write, not Daly's 118 s"
    assert schedule(slow, Policy(interval_s=400.0)).blocking == pytest.approx(1 + 1 + 600), "waits for the write"


def test_monte_carlo_agrees_with_young_daly_first_order_waste_within_2_percent() -> None:
    """Where the first-order formula holds: exponential failures, δ = 5 s and R = 34 s small against M = 24 h
    (second-order terms ~ δ/2M and (δ/τ)·(τ/2M) are < 0.5% of the waste), a year of work (365 failures a trial)."""
    run = small_run(mtbf_h=24.0, work_days=365.0)
    policy = Policy(name="sync", async_save=False, spare_nodes=0)
    s = schedule(run, policy)
    analytic = first_order_waste(s.blocking, s.tau, down_time(run, policy), run.mtbf_s)
    assert analytic == pytest.approx(5 / s.tau + (s.tau / 2 + 34) / 86400)
    result = simulate(run, policy, seed=1, trials=1000)
    simulated = float(np.mean(1 - result.goodput))
    assert abs(simulated - analytic) / analytic < 0.02, (simulated, analytic)
    assert result.stats("interruptions")["mean"] == pytest.approx(result.wall_s.mean() / run.mtbf_s, rel=0.01)


def test_llama3_interruptions_and_effective_training_time() -> None:
    run, policy = llama3_run()
    assert run.ckpt_bytes / run.devices <= 4e9, "per-GPU checkpoint state within Llama 3's published 4 GB"
    assert effective_ratio(run, policy) > 0.90
    started = time.perf_counter()
    result = simulate(run, policy, seed=0, trials=2000)
    assert time.perf_counter() - started < 1.0, "2,000 trials of 54 days on 16k GPUs in well under a second"
    counts = result.stats("interruptions")
    assert counts["p10"] <= LLAMA3_INTERRUPTIONS <= counts["p90"], counts
    assert result.stats("goodput")["p10"] > 0.90
    assert result.stats("wall_s")["p50"] / 86400 == pytest.approx(LLAMA3_DAYS, rel=0.02)


def test_simulator_accounting_and_the_failure_free_run() -> None:
    run = small_run(mtbf_h=1e12, work_days=1.0)
    policy = Policy(async_save=False, interval_s=864.0, spare_nodes=0)
    result = simulate(run, policy, seed=0, trials=10)
    assert (result.interruptions == 0).all()
    assert result.wall_s == pytest.approx(np.full(10, 86400 + 99 * 5.0)), "99 saves of 5 s; none after the end"
    busy = simulate(small_run(mtbf_h=2.0, work_days=2.0), Policy(), seed=3, trials=200)
    parts = busy.work_s + busy.checkpoint_s + busy.lost_s + busy.down_s
    assert parts == pytest.approx(busy.wall_s)
    assert (busy.lost_s >= 0).all() and (busy.down_s >= -1e-6).all() and (busy.interruptions > 0).all()


def reference_run(run: Run, policy: Policy, rng: np.random.Generator) -> tuple[float, int]:
    """One trial walked event by event, save by save: the simulator's rules written the slow, obvious way."""
    sched, rec = schedule(run, policy), run.recovery
    fixed = rec.detect_s + rec.restart_s + run.ckpt_bytes / run.storage.write_bw
    committed, resume, fail, count = 0.0, 0.0, rng.exponential(run.mtbf_s), 0
    while True:
        clock, done, commits = resume, committed, []
        while True:
            step = min(sched.tau, run.work_s - done)
            if done + step >= run.work_s:  # the last stretch, no save after it
                if clock + step <= fail:
                    return clock + step, count
                break
            clock, done = clock + step + sched.blocking, done + step
            commits.append((clock + sched.lag, done))
            if clock > fail:
                break
        committed = max([work for at, work in commits if at <= fail], default=committed)
        count += 1
        repair = rec.repair_s if rng.random() < run.failures.hardware_fraction else 0.0
        resume = max(resume, fail + repair + fixed)  # a failure during recovery overlaps with it
        fail += rng.exponential(run.mtbf_s)


@pytest.mark.parametrize("async_save", [False, True])
def test_simulator_matches_an_event_by_event_reference(async_save: bool) -> None:
    """No spares, half the failures wait 3 h for repair, M = 2 h, restore 400 s: recoveries often overlap."""
    run = Run(work_s=4 * 86400, devices=8, ckpt_bytes=400e9,
              failures=FailureModel(device_mtbf_h=16.0, hardware_fraction=0.5),
              storage=Storage(write_bw=1e9, host_copy_bw=25e9, save_overhead_s=1.0),
              recovery=Recovery(detect_s=60.0, restart_s=120.0, repair_s=3 * 3600.0))
    policy = Policy(async_save=async_save, interval_s=1800.0, spare_nodes=0)
    rng = np.random.default_rng(11)
    walls, counts = np.array([reference_run(run, policy, rng) for _ in range(400)]).T
    result = simulate(run, policy, seed=12, trials=2000)
    for ref, sim in ((walls, result.wall_s), (counts, result.interruptions)):
        se = math.hypot(ref.std() / math.sqrt(len(ref)), sim.std() / math.sqrt(len(sim)))
        assert abs(ref.mean() - sim.mean()) < 4 * se, (ref.mean(), sim.mean(), se)
    # Daly's complete model with merged recoveries (M/G/∞ busy periods) predicts the mean wall time as well.
    assert run.work_s / expected_goodput(run, policy) == pytest.approx(result.wall_s.mean(), rel=0.03)


def test_same_seed_same_results_and_another_seed_differs() -> None:
    run = small_run(mtbf_h=6.0, work_days=20.0)
    a, b = simulate(run, seed=7, trials=300), simulate(run, seed=7, trials=300)
    assert np.array_equal(a.wall_s, b.wall_s) and np.array_equal(a.interruptions, b.interruptions)
    assert not np.array_equal(a.wall_s, simulate(run, seed=8, trials=300).wall_s)


def test_weibull_with_shape_1_matches_exponential_within_monte_carlo_error() -> None:
    run = small_run(mtbf_h=6.0, work_days=30.0)
    weibull = replace(run, failures=FailureModel(device_mtbf_h=6.0, hardware_fraction=0.0, dist="weibull", shape=1.0))
    exp, wei = simulate(run, seed=1, trials=2000), simulate(weibull, seed=2, trials=2000)
    for name in ("wall_s", "interruptions"):
        x, y = getattr(exp, name), getattr(wei, name)
        se = math.hypot(x.std() / math.sqrt(len(x)), y.std() / math.sqrt(len(y)))
        assert abs(x.mean() - y.mean()) < 4 * se, (name, x.mean(), y.mean(), se)
    bursty = replace(run, failures=FailureModel(device_mtbf_h=6.0, hardware_fraction=0.0, dist="weibull", shape=0.6))
    bursts = simulate(bursty, seed=2, trials=2000)
    assert bursts.interruptions.std() > 1.3 * exp.interruptions.std()
    assert bursts.interruptions.mean() == pytest.approx(bursts.wall_s.mean() / run.mtbf_s, rel=0.03), "mean = MTBF"


def test_a_failure_during_the_background_write_loses_that_save() -> None:
    """Async, a 1000 s write every 3000 s of compute. A failure at a uniform point x of a period P = τ + δ loses
    the compute since the period began (x, or τ once in the save): (τ²/2 + τδ)/P on average; async also loses
    the previous period's τ when x falls in the write window (probability w/P). Exponential truncation takes
    ~P/12M ≈ 0.4% off."""
    run = Run(work_s=200 * 86400, devices=1, ckpt_bytes=100e9, failures=FailureModel(device_mtbf_h=24.0,
                                                                                   hardware_fraction=0.0),
              storage=Storage(write_bw=0.1e9, host_copy_bw=25e9, save_overhead_s=0.5))
    tau = 3000.0
    asyn = simulate(run, Policy(async_save=True, interval_s=tau, restore="memory", spare_nodes=0), seed=4,
                    trials=500)
    sync = simulate(run, Policy(async_save=False, interval_s=tau, restore="memory", spare_nodes=0), seed=4,
                    trials=500)
    (pa, da), (ps, ds) = ((r.schedule.period, r.schedule.blocking) for r in (asyn, sync))
    assert asyn.schedule.lag == 1000.0 and da == pytest.approx(4.5) and ds == pytest.approx(1000.5)
    async_loss = (tau**2 / 2 + tau * da) / pa + 1000 / pa * tau
    assert asyn.lost_s.sum() / asyn.interruptions.sum() == pytest.approx(async_loss, rel=0.02)
    assert sync.lost_s.sum() / sync.interruptions.sum() == pytest.approx((tau**2 / 2 + tau * ds) / ps, rel=0.02)


def test_compare_policies_side_by_side_on_llama3() -> None:
    run, _ = llama3_run()
    results = compare_policies(run, seed=0, trials=500)
    rows = {r.policy.name: r for r in results}
    assert list(rows) == ["async, optimal interval, disk restore, spares", "sync saves", "fixed interval 60 min",
                          "in-memory/peer restore", "no spare nodes", "memory + storage tiers"]
    base = results[0].stats("goodput")["mean"]
    assert rows["sync saves"].stats("goodput")["mean"] < base
    assert rows["fixed interval 60 min"].stats("goodput")["mean"] < base - 0.05
    assert rows["in-memory/peer restore"].schedule.restore_s < results[0].schedule.restore_s
    assert rows["in-memory/peer restore"].stats("goodput")["mean"] >= base
    assert rows["no spare nodes"].stats("wall_s")["p50"] > 1.5 * results[0].stats("wall_s")["p50"]
    assert {"policy", "interval_s", "wall_days", "goodput", "interruptions"} <= set(results[0].row())
    two = rows["memory + storage tiers"]
    assert two.stats("goodput")["mean"] > base and two.row()["memory_interval_s"] < two.row()["interval_s"]
    assert two.lost_per_failure_s < results[0].lost_per_failure_s


def test_a_run_that_cannot_progress_is_refused() -> None:
    run = Run(work_s=86400.0, devices=1, ckpt_bytes=1e9, failures=FailureModel(device_mtbf_h=0.01))
    with pytest.raises(KeelError, match="cannot make progress"):
        simulate(run, Policy(spare_nodes=0), trials=10)


def test_cost_splits_productive_checkpointing_and_failures() -> None:
    c = cost(100, work_s=36000.0, checkpoint_s=360.0, lost_s=720.0, down_s=1080.0, spare_devices=8,
             price_per_hour=3.0)
    assert c.productive_h == 1000 and c.checkpoint_h == 10 and c.lost_h == 20 and c.down_h == 30
    assert c.spares_h == pytest.approx(8 * 10.6) and c.failures_h == pytest.approx(50 + 8 * 10.6)
    assert c.money == pytest.approx(3.0 * c.gpu_hours)
    assert sum(p["share"] for n, p in c.parts().items() if "." not in n) == pytest.approx(1.0)
    run = small_run(mtbf_h=6.0, work_days=10.0)
    result = simulate(run, Policy(spare_nodes=0), seed=0, trials=500)
    mean = cost_of(result, run)
    assert mean.gpu_hours == pytest.approx(result.wall_s.mean() / 3600)
    assert mean.price_per_hour == DEFAULT_PRICE_PER_HOUR
    spread = money_percentiles(result, run)
    assert spread["p10"] <= spread["p50"] <= spread["p90"]
    assert expected_cost(run, Policy(spare_nodes=0)).money == pytest.approx(mean.money, rel=0.01)


@FAST
@given(mtbf_h=st.floats(0.5, 500.0), factor=st.floats(1.0, 10.0), async_save=st.booleans(),
       interval=st.sampled_from([None, 1800.0]), price=st.floats(0.5, 10.0))
def test_predicted_cost_is_non_decreasing_in_the_failure_rate(mtbf_h: float, factor: float, async_save: bool,
                                                              interval: float | None, price: float) -> None:
    policy = Policy(async_save=async_save, interval_s=interval, spare_nodes=0)
    rare, frequent = small_run(mtbf_h=mtbf_h), small_run(mtbf_h=mtbf_h / factor)
    assert expected_cost(frequent, policy, price).money >= expected_cost(rare, policy, price).money * (1 - 1e-12)


@settings(max_examples=10, deadline=None, derandomize=True)
@given(mtbf_h=st.floats(2.0, 50.0), factor=st.floats(1.25, 4.0), interval=st.sampled_from([None, 1800.0]))
def test_simulated_cost_is_non_decreasing_in_the_failure_rate(mtbf_h: float, factor: float,
                                                              interval: float | None) -> None:
    policy = Policy(interval_s=interval, spare_nodes=0)
    rare, frequent = small_run(mtbf_h=mtbf_h, work_days=10), small_run(mtbf_h=mtbf_h / factor, work_days=10)
    assert cost_of(simulate(frequent, policy, seed=0, trials=300), frequent).money >= cost_of(
        simulate(rare, policy, seed=0, trials=300), rare).money


@settings(max_examples=15, deadline=None, derandomize=True)
@given(mtbf_h=st.floats(1.0, 100.0), size_gb=st.floats(1.0, 1000.0), write_gbps=st.floats(0.5, 12.5),
       position=st.floats(0.0, 1.0))
def test_async_checkpoints_never_waste_more_than_sync_at_the_same_interval(
        mtbf_h: float, size_gb: float, write_gbps: float, position: float) -> None:
    """Where async saving is the point: the copy to host is at most half the write (25 GB/s per device against
    ≤ 12.5 GB/s of storage) and the interval lies between the write time and half the MTBF. Async
    blocks for less but a failure during the write loses that save: first order, it wins iff
    (w − c)/τ ≥ (w + c)/2M, true in this domain. Same seed: both meet the same failures."""
    run = Run(work_s=20 * mtbf_h * 3600, devices=1, ckpt_bytes=size_gb * 1e9,
              failures=FailureModel(device_mtbf_h=mtbf_h, hardware_fraction=0.0),
              storage=Storage(write_bw=write_gbps * 1e9, host_copy_bw=25e9, save_overhead_s=0.5))
    write = run.ckpt_bytes / run.storage.write_bw
    if write > mtbf_h * 3600 / 2:
        return
    interval = write + position * (mtbf_h * 3600 / 2 - write)
    sync = simulate(run, Policy(async_save=False, interval_s=interval, spare_nodes=0), seed=5, trials=400)
    asyn = simulate(run, Policy(async_save=True, interval_s=interval, spare_nodes=0), seed=5, trials=400)
    diff = (1 - asyn.goodput) - (1 - sync.goodput)
    assert diff.mean() <= 3 * diff.std() / math.sqrt(len(diff)) + 1e-12, (diff.mean(), diff.std())


def tiered_run(coverage: float = 0.8, work_days: float = 30.0) -> Run:
    """One device, M = 10 h, a 25 GB checkpoint: a memory save blocks 1 + 0.5 s (copy at 25 GB/s, commit) and
    replicates in 0.5 s at 50 GB/s; a sync storage save blocks 25 + 1 s at 1 GB/s."""
    return Run(work_s=work_days * 86400, devices=1, ckpt_bytes=25e9,
               failures=FailureModel(device_mtbf_h=10.0, hardware_fraction=0.0, memory_coverage=coverage),
               storage=Storage(write_bw=1e9, host_copy_bw=25e9, peer_bw=50e9, save_overhead_s=1.0,
                               memory_overhead_s=0.5),
               recovery=Recovery(detect_s=10.0, restart_s=20.0, repair_s=3600.0))


def test_each_tier_takes_young_daly_against_the_failures_it_serves() -> None:
    run = tiered_run(coverage=0.8)
    assert memory_save_times(run) == pytest.approx((1.5, 0.5))
    tau_m, tau_s = young_daly_tiers(run, async_save=False)
    # Young by hand: √(2·1.5·36,000 / 0.8) = 367.4 s and √(2·26·36,000 / 0.2) = 3,059.4 s; Daly's terms take
    # off under 1%.
    assert tau_m == pytest.approx(367.4, rel=0.01) and tau_m == daly_interval(1.5, 36_000 / 0.8)
    assert tau_s == pytest.approx(3059.4, rel=0.01) and tau_s == daly_interval(26.0, 36_000 / 0.2)
    two = tiers(run, Policy(async_save=False, memory_tier=True))
    assert two is not None and two.every == round(tau_s / tau_m) == 8
    assert two.memory.tau == tau_m and two.storage.tau == pytest.approx(8 * tau_m)
    assert two.storage.period == pytest.approx(8 * (tau_m + 1.5) + 26.0)
    assert (two.memory.restore_s, two.storage.restore_s) == pytest.approx((0.5, 25.0))
    assert down_time(run, Policy(async_save=False, memory_tier=True)) == pytest.approx(30 + 0.8 * 0.5 + 0.2 * 25)
    fixed = tiers(run, Policy(async_save=False, memory_tier=True, memory_interval_s=600.0, interval_s=3000.0))
    assert fixed is not None and (fixed.memory.tau, fixed.every, fixed.storage.tau) == (600.0, 5, 3000.0)


def test_default_memory_coverage_is_llama3_less_its_switch_and_cable_failures() -> None:
    assert DEFAULT_MEMORY_COVERAGE == pytest.approx(1 - 35 / 419) == FailureModel().memory_coverage
    assert 0.91 < DEFAULT_MEMORY_COVERAGE < 0.92


def test_without_memory_coverage_two_tiers_are_storage_only_exactly() -> None:
    run = replace(tiered_run(), failures=replace(tiered_run().failures, memory_coverage=0.0))
    assert tiers(run, Policy(memory_tier=True)) is None, "the optimum is never to save to memory"
    one, two = (simulate(run, Policy(memory_tier=tier, spare_nodes=2), seed=3, trials=300) for tier in (False, True))
    assert np.array_equal(one.goodput, two.goodput)
    # The two-tier replay itself, with memory saves that cost nothing, at the storage interval: the same run.
    free = replace(run, storage=replace(run.storage, host_copy_bw=math.inf, peer_bw=math.inf, memory_overhead_s=0))
    for async_save in (False, True):
        one, two = (simulate(free, Policy(async_save=async_save, interval_s=1800.0, spare_nodes=2, **tier), seed=3,
                             trials=300) for tier in ({}, {"memory_tier": True, "memory_interval_s": 1800.0}))
        assert two.tiers is not None and np.array_equal(one.goodput, two.goodput)
        assert np.array_equal(one.lost_s, two.lost_s) and np.array_equal(two.storage_restores, two.interruptions)


def test_with_full_coverage_storage_saves_are_never_restored_from() -> None:
    run = tiered_run(coverage=1.0)
    result = simulate(run, Policy(async_save=False, memory_tier=True, memory_interval_s=600.0, interval_s=3600.0),
                      seed=2, trials=300)
    assert result.interruptions.sum() > 1000 and result.storage_restores.sum() == 0
    period = 600 + 1.5
    assert result.lost_per_failure_s == pytest.approx((600**2 / 2 + 600 * 1.5) / period, rel=0.03), "memory's"
    optimal = tiers(run, Policy(memory_tier=True))
    assert optimal is not None and optimal.storage.tau >= run.work_s, "no storage save during the run"


def test_intervals_done_matches_counting_interval_by_interval() -> None:
    two = tiers(tiered_run(), Policy(async_save=False, memory_tier=True, memory_interval_s=600.0,
                                     interval_s=2400.0))
    assert two is not None and two.every == 4
    rng = np.random.default_rng(0)
    pos, up = rng.integers(0, 50, 2000).astype(float), rng.uniform(-100, 20_000, 2000)
    counted = np.zeros_like(up)
    for i in range(len(up)):
        n = 0
        while _wall_of(pos[i:i + 1], np.array([n + 1.0]), two)[0] <= up[i]:
            n += 1
        counted[i] = n
    assert np.array_equal(_intervals_done(pos, up, two), counted)


def test_two_tier_simulator_agrees_with_the_first_order_and_complete_models() -> None:
    """A year of work at M = 24 h, waste small (second-order terms < 1% of it): the Monte Carlo waste is the
    first-order two-tier waste within 2%, and the nested Daly model's within 0.05 points of goodput."""
    run = replace(small_run(mtbf_h=24.0, work_days=365.0), failures=FailureModel(
        device_mtbf_h=24.0, hardware_fraction=0.0, memory_coverage=0.9))
    policy = Policy(async_save=False, spare_nodes=0, memory_tier=True)
    two = tiers(run, policy)
    assert two is not None
    m, s = two.memory, two.storage
    analytic = two_tier_waste((m.blocking, m.tau, 30 + m.restore_s + m.lag), (s.blocking, s.tau, 34.0), 0.9,
                              run.mtbf_s)
    result = simulate(run, policy, seed=1, trials=1000)
    simulated = float(np.mean(1 - result.goodput))
    assert abs(simulated - analytic) / analytic < 0.02, (simulated, analytic)
    assert effective_ratio(run, policy) == pytest.approx(1 - analytic)
    assert float(result.goodput.mean()) == pytest.approx(expected_goodput(run, policy), abs=5e-4)
    assert result.storage_restores.sum() / result.interruptions.sum() == pytest.approx(0.1, abs=0.01)


def test_two_tiers_beat_storage_only_on_llama3() -> None:
    """Llama 3 405B's run (16,384 H100, M = 3.1 h), each side at its optimal intervals: 91.6% of the failures
    restart from a memory save taken every ~53 s instead of a storage save every ~2.5 min (async) or ~5 min
    (sync), and storage saves grow ~3.5 times rarer."""
    run, _ = llama3_run()
    for async_save in (True, False):
        one, two = (simulate(run, Policy(async_save=async_save, spare_nodes=16, memory_tier=tier), seed=0,
                             trials=500) for tier in (False, True))
        assert two.stats("goodput")["mean"] > one.stats("goodput")["mean"] + 0.004
        assert two.lost_per_failure_s < 0.7 * one.lost_per_failure_s
        assert two.schedule.tau > 3 * one.schedule.tau
        assert expected_goodput(run, two.policy) == pytest.approx(two.stats("goodput")["mean"], abs=1e-3)
    assert two.tiers is not None
    traffic = replication(run, two.tiers)
    assert traffic["bytes_per_device"] == pytest.approx(run.ckpt_bytes / LLAMA3_GPUS)
    assert traffic["seconds"] == pytest.approx(traffic["bytes_per_device"] / 50e9) and traffic["link_share"] < 1e-3


@pytest.mark.parametrize("make", [
    lambda: Policy(interval_s=-60.0), lambda: Policy(memory_tier=True, memory_interval_s=-1.0),
    lambda: Policy(memory_tier=True, memory_interval_s=math.inf), lambda: FailureModel(memory_coverage=1.5),
    lambda: FailureModel(memory_coverage=-0.1), lambda: FailureModel(memory_coverage=math.nan),
    lambda: Policy(memory_interval_s=60.0), lambda: Policy(memory_tier=True, restore="memory")])
def test_bad_two_tier_input_is_refused_in_one_line(make: object) -> None:
    with pytest.raises(KeelError) as raised:
        make()  # type: ignore[operator]
    assert "\n" not in str(raised.value)


def test_a_two_tier_base_is_compared_with_storage_only_and_costed_like_its_simulation() -> None:
    run = tiered_run(coverage=0.9, work_days=20.0)
    base = Policy(name="two tiers", async_save=False, spare_nodes=0, memory_tier=True)
    rows = {r.policy.name: r for r in compare_policies(run, seed=0, trials=300, base=base)}
    assert rows["storage only"].tiers is None and rows["in-memory/peer restore"].tiers is None
    assert rows["two tiers"].stats("goodput")["mean"] > rows["storage only"].stats("goodput")["mean"]
    assert rows["fixed interval 60 min"].tiers is not None
    simulated = cost_of(rows["two tiers"], run)
    predicted = expected_cost(run, base)
    assert predicted.money == pytest.approx(simulated.money, rel=0.01)
    assert predicted.checkpoint_h == pytest.approx(simulated.checkpoint_h, rel=0.02)


def test_a_run_without_failures_is_down_for_no_time_and_costs_its_work() -> None:
    # A week on one device that fails once in 114 years: most trials meet no failure, and the wall time less the
    # work, saves and lost work must leave no time down rather than a rounding error below zero.
    run = small_run(mtbf_h=1e6, work_days=7.3)
    result = simulate(run, trials=50)
    assert (result.down_s >= 0).all() and (result.interruptions == 0).any()
    spent = cost_of(result, run)
    assert spent.down_h == 0.0 and spent.productive_h == pytest.approx(run.work_s / 3600)


def test_each_way_a_failure_shows_is_charged_its_own_detection() -> None:
    rec = Recovery(detect_s=100.0, hang_detect_s=600.0, silent_detect_s=3000.0, triage_s=7200.0)
    assert rec.detection_s(FailureMix()) == 100.0
    mix = FailureMix(hang=0.1, silent=0.02, manual=0.05)
    assert rec.detection_s(mix) == pytest.approx(0.88 * 100 + 0.1 * 600 + 0.02 * 3000 + 0.05 * 7200)
    run = Run(work_s=86400 * 30, devices=1024, ckpt_bytes=1e12, failures=FailureModel(mix=mix), recovery=rec)
    plain = replace(run, failures=FailureModel())
    extra = rec.detection_s(mix) - rec.detection_s(FailureMix())
    assert down_time(run, Policy()) == pytest.approx(down_time(plain, Policy()) + extra)
    assert simulate(run, seed=3, trials=300).down_s.mean() > simulate(plain, seed=3, trials=300).down_s.mean()


def test_rollbacks_redo_their_share_of_the_compute_in_every_model() -> None:
    rec = Recovery(rollback_s=1800.0)
    run = Run(work_s=86400 * 20, devices=8, ckpt_bytes=1e9, recovery=rec,
              failures=FailureModel(device_mtbf_h=1e12, mix=FailureMix(rollbacks_per_day=2.0)))
    share = 2 * 1800 / 86400
    calm = replace(run, failures=FailureModel(device_mtbf_h=1e12))
    result = simulate(run, seed=0, trials=50)
    assert result.lost_s.mean() == pytest.approx(run.work_s * share, rel=1e-6)
    assert expected_goodput(run, Policy()) == pytest.approx(expected_goodput(calm, Policy()) / (1 + share))
    assert effective_ratio(run, Policy()) == pytest.approx(effective_ratio(calm, Policy()) - share)


@pytest.mark.parametrize("mix", [dict(hang=1.5), dict(silent=-0.1), dict(hang=0.7, silent=0.5),
                                 dict(rollbacks_per_day=math.inf), dict(manual=math.nan)])
def test_a_bad_mix_is_refused_in_one_line(mix: dict) -> None:
    with pytest.raises(KeelError) as e:
        FailureMix(**mix)
    assert "\n" not in str(e.value) and "failure mix" in str(e.value)
