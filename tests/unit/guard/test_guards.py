"""Guard building blocks in one process: the numerics and spike guards, fingerprints, the snapshot ring
and skipped data."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from keel.config import GuardConfig, OptimConfig, SpikeConfig
from keel.core.sync import StepReport
from keel.guard.numerics import NumericsGuard
from keel.guard.sdc import fingerprint, same_bits
from keel.guard.snapshots import SnapshotRing, live_tensors
from keel.guard.spike import SpikeGuard, robust_score
from keel.train.optim import build_optimizer


def report(step: int, loss: float = 3.0, grad_norm: float = 1.0, nonfinite: list[int] | None = None) -> StepReport:
    return StepReport(step=step, loss=loss, grad_norm=grad_norm, local_loss=loss, nonfinite_ranks=nonfinite or [])


# ------------------------------------------------------------------ numerics


def test_numerics_skips_then_rolls_back_after_consecutive_skips() -> None:
    cfg = GuardConfig()
    guard = NumericsGuard(cfg)
    assert guard.inspect(report(10)) is None
    first = guard.inspect(report(11, loss=float("nan"), nonfinite=[1]))
    assert first.kind == "skip" and first.evidence["ranks"] == [1]
    assert guard.inspect(report(12, grad_norm=float("inf"), nonfinite=[0])).kind == "skip"
    third = guard.inspect(report(13, grad_norm=float("nan"), nonfinite=[0, 1]))
    assert third.kind == "rollback" and third.evidence["consecutive"] == 3
    assert third.to_step == 13 - 3 - cfg.rollback_steps + 1 and third.skip_batches == cfg.skip_batches
    assert guard.inspect(report(14)) is None and guard.consecutive == 0


def test_numerics_can_stop_instead() -> None:
    cfg = GuardConfig()
    cfg.numerics.on_nonfinite = "stop"
    assert NumericsGuard(cfg).inspect(report(3, loss=float("inf"), nonfinite=[0])).kind == "stop"


# ------------------------------------------------------------------ spikes


def test_robust_score_is_mads_above_the_median() -> None:
    score, median = robust_score([1.0, 2.0, 3.0, 4.0, 5.0], 8.0)
    assert median == 3.0 and score == pytest.approx(5.0 / 1.4826)
    # A flat window: the MAD is floored at 1% of the median, so noise does not become a spike.
    score, _ = robust_score([2.0] * 10, 2.001)
    assert score == pytest.approx(0.05)


def noisy_losses(n: int, seed: int = 0) -> list[float]:
    rng = random.Random(seed)
    return [3.0 - 0.001 * i + rng.gauss(0, 0.03) for i in range(n)]


def test_spike_guard_ignores_noise_and_warmup_and_rolls_back_on_a_spike() -> None:
    cfg = GuardConfig(rollback_steps=7, skip_batches=40)
    cfg.spike.grad_threshold = 12.0
    guard = SpikeGuard(cfg)
    assert guard.inspect(report(1, loss=50.0)) is None  # warm-up: nothing is judged yet
    guard.history.clear()
    for step, loss in enumerate(noisy_losses(300), start=1):
        assert guard.inspect(report(step, loss=loss, grad_norm=1.0 + 0.05 * random.Random(step).random())) is None
    assert len(guard.history) == cfg.spike.window
    action = guard.inspect(report(301, loss=4.5))
    assert action.kind == "rollback" and action.guard == "spike"
    assert action.to_step == 301 - 7 and action.skip_batches == 40
    assert action.evidence["loss"] == 4.5 and action.evidence["loss_score"] > cfg.spike.loss_threshold
    assert guard.history[-1][0] == 300, "a spike does not enter the window"
    grad = guard.inspect(report(302, loss=2.7, grad_norm=40.0))
    assert grad.kind == "rollback" and "grad_norm" in grad.evidence and "loss" not in grad.evidence


def test_spike_needs_a_real_rise_and_honours_the_response() -> None:
    cfg = GuardConfig()
    cfg.spike.min_rise = 0.5
    guard = SpikeGuard(cfg)
    for step in range(1, 101):
        guard.inspect(report(step, loss=3.0 + (0.001 if step % 2 else 0.0)))
    assert guard.inspect(report(101, loss=3.5)) is None  # many MADs, but under a 50% rise
    for response, kind in (("skip", "skip"), ("log", "continue")):
        cfg.spike.response = response
        action = guard.inspect(report(102, loss=9.0))
        assert action.kind == kind and action.reason
    cfg.spike.response = "off"
    assert guard.inspect(report(103, loss=9.0)) is None


# Every step's loss and gradient norm, as the spike guard was given them, in the clean runs of the soak of
# tests/dist/test_guards.py with the detectors every 5 steps (the command of each run is recorded beside them).
CLEAN_STEPS = Path(__file__).with_name("clean_steps.json")


def test_the_spike_guard_takes_no_action_over_two_thousand_recorded_clean_steps() -> None:
    """The guard decides on each step's loss and gradient norm against the history of those alone, and a run
    is deterministic: these decisions are the ones made live in those runs, at default thresholds."""
    runs = json.loads(CLEAN_STEPS.read_text())["runs"]
    for run in runs:
        guard = SpikeGuard(GuardConfig())
        for step, (loss, grad_norm) in enumerate(zip(run["loss"], run["grad_norm"], strict=True), start=1):
            assert guard.inspect(report(step, loss=loss, grad_norm=grad_norm)) is None, (run["layout"], step)
        assert len(guard.history) == guard.spike.window, "every step entered the window"
    assert sum(len(run["loss"]) for run in runs) == 2000  # judged after each run's first `warmup` (50)


def test_spike_history_survives_a_checkpoint() -> None:
    guard = SpikeGuard(GuardConfig())
    for step in range(1, 61):
        guard.inspect(report(step))
    assert guard.history[-1][0] == 60
    again = SpikeGuard(GuardConfig())
    again.load_state_dict(guard.state_dict())
    assert again.history == guard.history


# ------------------------------------------------------------------ fingerprints


@pytest.mark.parametrize("dtype, bits", [(torch.float32, 32), (torch.bfloat16, 16)])
def test_fingerprint_changes_for_a_flip_of_any_bit(dtype: torch.dtype, bits: int) -> None:
    t = torch.randn(1000).to(dtype)
    clean = fingerprint([t])
    assert torch.equal(clean, fingerprint([t.clone()]))
    int_view = {32: torch.int32, 16: torch.int16}[bits]
    for bit in range(bits):
        flipped = t.clone()
        flipped.view(int_view)[123] ^= torch.tensor(1, dtype=int_view) << bit
        assert not torch.equal(fingerprint([flipped]), clean), bit


def test_fingerprint_has_one_entry_per_tensor_and_reads_missing_gradients_as_zero() -> None:
    a, b = torch.ones(3), torch.zeros(2)
    fp = fingerprint([a, None, b])
    assert fp.shape == (3,) and fp[1] == 0 and fp[2] == 0 and fp[0] != 0
    assert same_bits(float("nan"), float("nan")) and not same_bits(0.0, -0.0)


# ------------------------------------------------------------------ snapshots


def tiny_model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
    return model, build_optimizer(model, OptimConfig())


def train_one_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.randn(5, 4)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def test_snapshot_ring_restores_parameters_optimizer_state_and_rng_exactly() -> None:
    model, optimizer = tiny_model_and_optimizer()
    ring = SnapshotRing([optimizer], count=2, pin_memory=False)
    ring.take(0, {"train": {"step": 0}})
    train_one_step(model, optimizer)
    ring.take(1, {"train": {"step": 1}})
    saved = [t.clone() for t in live_tensors([optimizer])[0]]
    expected_draw = torch.rand(3)
    for _ in range(3):
        train_one_step(model, optimizer)
    ring.take(4, {"train": {"step": 4}})
    assert [s.step for s in ring.snapshots] == [1, 4], "the ring keeps the newest two"
    assert ring.newest(3).step == 1 and ring.newest(0) is None

    host = ring.restore(ring.newest(3))
    assert host == {"train": {"step": 1}}
    for now, then in zip(live_tensors([optimizer])[0], saved, strict=True):
        assert torch.equal(now, then)
    assert torch.equal(torch.rand(3), expected_draw), "RNG streams come back too"
    assert [s.step for s in ring.snapshots] == [1], "snapshots of abandoned steps are dropped"


def test_restoring_a_snapshot_from_before_the_first_update_clears_optimizer_state() -> None:
    model, optimizer = tiny_model_and_optimizer()
    ring = SnapshotRing([optimizer], count=1, pin_memory=False)
    before = [p.detach().clone() for p in model.parameters()]
    ring.take(0, {})
    train_one_step(model, optimizer)
    ring.restore(ring.newest(0))
    assert not optimizer.state
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))


def test_a_kept_snapshot_stays_out_of_the_rotation_until_another_is_kept() -> None:
    model, optimizer = tiny_model_and_optimizer()
    ring = SnapshotRing([optimizer], count=2, pin_memory=False)
    ring.take(10, {"train": {"step": 10}})
    ring.keep(10)
    for step in (12, 14, 16):
        train_one_step(model, optimizer)
        ring.take(step, {"train": {"step": step}})
    assert [s.step for s in ring.snapshots] == [10, 14, 16], "two rotating besides the kept one"
    ring.take(16, {"train": {"step": 16}})
    assert [s.step for s in ring.snapshots] == [10, 14, 16], "a step taken again reuses its own slot"
    ring.keep(16)
    train_one_step(model, optimizer)
    ring.take(18, {"train": {"step": 18}})
    assert [s.step for s in ring.snapshots] == [14, 16, 18], "the one kept before rotates again, and goes first"
    with pytest.raises(ValueError, match="no snapshot of step 15"):
        ring.keep(15)
    ring.clear()
    ring.take(10, {"train": {"step": 10}})
    ring.keep(10)
    verified = [t.clone() for t in live_tensors([optimizer])[0]]
    train_one_step(model, optimizer)
    ring.take(20, {"train": {"step": 20}})
    assert ring.restore(ring.newest(10)) == {"train": {"step": 10}}
    assert all(torch.equal(a, b) for a, b in zip(live_tensors([optimizer])[0], verified, strict=True))
    assert ring.kept == 10 and [s.step for s in ring.snapshots] == [10]


def test_going_back_before_the_kept_snapshot_keeps_the_newest_left() -> None:
    _, optimizer = tiny_model_and_optimizer()
    ring = SnapshotRing([optimizer], count=2, pin_memory=False)
    for step in (5, 10):
        ring.take(step, {})
    ring.keep(10)
    ring.forget_after(7)  # a spike rollback (or a checkpoint's state) from before the verified step
    assert [s.step for s in ring.snapshots] == [5] and ring.kept == 5
    ring.forget_after(3)
    assert ring.snapshots == [] and ring.kept is None


def test_an_attention_logit_above_the_threshold_is_a_spike_seen_after_the_update() -> None:
    signals = {"signals/attn_logit_max": 250.0, "signals/attn_logit_max/layer_0": 12.0,
               "signals/attn_logit_max/layer_1": 250.0}
    off = SpikeGuard(GuardConfig())
    assert off.inspect_signals(30, signals) is None  # threshold 0: not checked
    guard = SpikeGuard(GuardConfig(rollback_steps=5, spike=SpikeConfig(attn_logit_threshold=100.0)))
    assert guard.inspect_signals(30, {**signals, "signals/attn_logit_max": 99.0}) is None
    assert guard.inspect_signals(30, {}) is None  # a step that computed no signals
    action = guard.inspect_signals(30, signals)
    assert action is not None and action.kind == "rollback" and action.to_step == 25
    assert "attention logit 250 is above guard.spike.attn_logit_threshold = 100 (layer 1)" in action.reason
    logged = SpikeGuard(GuardConfig(spike=SpikeConfig(attn_logit_threshold=100.0, response="log")))
    assert logged.inspect_signals(30, signals).kind == "continue"  # type: ignore[union-attr]
