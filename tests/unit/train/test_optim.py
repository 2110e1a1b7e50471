"""Learning-rate schedules, AdamW parameter groups, gradient accumulation and clipping."""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable, Iterable

import pytest
import torch

from keel.config import ModelConfig, OptimConfig
from keel.model.init import init_weights
from keel.model.llama import Llama
from keel.train.optim import build_optimizer, lr_at
from keel.train.step import Stepper

TINY = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=61, multiple_of=16, max_seq_len=16)
TOTAL, WARMUP, LR, RATIO = 100, 10, 2e-3, 0.1


def schedule(name: str, **changes: float) -> list[float]:
    cfg = OptimConfig(**{"lr": LR, "warmup_steps": WARMUP, "min_lr_ratio": RATIO, "schedule": name, **changes})
    return [lr_at(step, cfg, TOTAL) for step in range(TOTAL)]


# ---------------------------------------------------------------- schedules

@pytest.mark.parametrize("name", ["cosine", "wsd", "constant"])
def test_warmup_is_linear_to_the_peak(name: str) -> None:
    lrs = schedule(name)
    assert lrs[0] == pytest.approx(LR / WARMUP)
    for step in range(WARMUP):
        assert lrs[step] == pytest.approx(LR * (step + 1) / WARMUP)
    assert lrs[WARMUP - 1] == pytest.approx(LR)  # the peak is reached on the last warmup step
    assert max(lrs) == pytest.approx(LR)
    assert min(lrs) >= LR * RATIO * (1 - 1e-12)


@pytest.mark.parametrize("name", ["cosine", "wsd", "constant"])
def test_no_warmup_starts_at_the_peak(name: str) -> None:
    assert schedule(name, warmup_steps=0)[0] == pytest.approx(LR)


def test_cosine_decays_monotonically_towards_the_floor() -> None:
    lrs = schedule("cosine")
    after = lrs[WARMUP - 1:]
    assert all(b <= a for a, b in zip(after, after[1:], strict=False))
    assert lrs[WARMUP + 1] < LR  # decay starts right after warmup (no flat phase)
    # Cosine shape: half-way through the decay the rate is half-way between peak and floor.
    mid = lrs[WARMUP + (TOTAL - WARMUP) // 2]
    assert mid == pytest.approx((LR + LR * RATIO) / 2, rel=0.05)
    assert lrs[-1] == pytest.approx(LR * RATIO, rel=0.01)


def test_cosine_reaches_the_floor_at_the_last_step() -> None:
    assert schedule("cosine")[-1] == pytest.approx(LR * RATIO, rel=1e-9)


def test_wsd_is_flat_then_decays_linearly_to_the_floor() -> None:
    lrs = schedule("wsd", decay_fraction=0.2)
    decay_start = TOTAL - 20
    assert all(lr == LR for lr in lrs[WARMUP:decay_start])
    decay = lrs[decay_start:]
    assert decay[0] < LR
    steps = [a - b for a, b in zip(decay, decay[1:], strict=False)]
    assert steps == pytest.approx([(LR - LR * RATIO) / 20] * len(steps))  # linear: equal decrements
    assert lrs[-1] == pytest.approx(LR * RATIO, rel=1e-9)


def test_wsd_decay_fraction_sets_the_decay_length() -> None:
    lrs = schedule("wsd", decay_fraction=0.5)
    assert lrs[TOTAL // 2 - 1] == LR and lrs[TOTAL // 2] < LR
    assert lrs[-1] == pytest.approx(LR * RATIO, rel=1e-9)


def test_constant_holds_the_peak() -> None:
    assert all(lr == LR for lr in schedule("constant")[WARMUP:])


# ---------------------------------------------------------------- optimizer

def test_weight_decay_only_on_matrices() -> None:
    for tie in (False, True):
        model = Llama(dataclasses.replace(TINY, tie_embeddings=tie))
        cfg = OptimConfig(lr=1e-3, weight_decay=0.05, beta1=0.8, beta2=0.9, eps=1e-7)
        optimizer = build_optimizer(model, cfg)
        decayed = {id(p) for g in optimizer.param_groups if g["weight_decay"] > 0 for p in g["params"]}
        not_decayed = {id(p) for g in optimizer.param_groups if g["weight_decay"] == 0 for p in g["params"]}
        assert decayed == {id(p) for p in model.parameters() if p.ndim >= 2}
        assert not_decayed == {id(p) for n, p in model.named_parameters() if n.endswith("norm.weight")}
        # Every parameter exactly once (a tied embedding must not be in two groups).
        all_params = [p for g in optimizer.param_groups for p in g["params"]]
        assert len(all_params) == len({id(p) for p in all_params}) == len(list(model.parameters()))
        for group in optimizer.param_groups:
            assert group["weight_decay"] in (0.0, 0.05)
            assert (group["lr"], group["betas"], group["eps"]) == (1e-3, (0.8, 0.9), 1e-7)



def test_a_state_saved_by_the_foreach_kernels_resumes_in_the_fused_ones() -> None:
    """Each group steps in one fused kernel; a state dict whose groups name other kernels (a checkpoint of the
    foreach AdamW) loads without changing them, and the next update is the one the saving optimizer makes."""
    cfg = OptimConfig(lr=1e-2, weight_decay=0.1)
    saving, resuming = tiny_model(), tiny_model(seed=1)
    optimizer = build_optimizer(saving, cfg)
    assert all(g["fused"] and not g["foreach"] for g in optimizer.param_groups)
    for _ in range(2):
        train_step(saving, optimizer, [batch()], lr=cfg.lr, grad_clip=1.0)
    saved = copy.deepcopy(optimizer.state_dict())  # loading keeps the tensors it is given
    saved["param_groups"] = [{**g, "fused": None, "foreach": True} for g in saved["param_groups"]]
    resumed = build_optimizer(resuming, cfg)
    resuming.load_state_dict(saving.state_dict())
    resumed.load_state_dict(saved)
    assert all(g["fused"] and not g["foreach"] for g in resumed.param_groups)
    for model, opt in ((saving, optimizer), (resuming, resumed)):
        train_step(model, opt, [batch()], lr=cfg.lr, grad_clip=1.0)
    for a, b in zip(saving.parameters(), resuming.parameters(), strict=True):
        assert torch.equal(a, b)

# ---------------------------------------------------------------- train step

def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
               micro_batches: list[tuple[torch.Tensor, torch.Tensor]], *, lr: float,
               grad_clip: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The Trainer's step on one model: forward/backward, the global norm, clip and update; this rank's
    loss and the norm before clipping."""
    stepper = Stepper([model], [optimizer], None, grad_clip=grad_clip, autocast_dtype=None)
    loss = stepper.forward_backward(micro_batches)
    norm = stepper.grad_norm()
    stepper.update(lr, norm)
    return loss, norm


def grad_norm_and_clip(params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """The Trainer's global norm and clip of `params`' gradients."""
    stepper = Stepper([torch.nn.ParameterList(params)], [], None, grad_clip=max_norm, autocast_dtype=None)
    norm = stepper.grad_norm()
    stepper.clip(norm)
    return norm


class RecordingSGD(torch.optim.SGD):
    """SGD that keeps a copy of the gradients it was asked to apply (train_step zeroes them afterwards)."""

    def __init__(self, params: Iterable[torch.nn.Parameter], lr: float = 1.0) -> None:
        super().__init__(params, lr=lr)
        self.grads: list[torch.Tensor] = []

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        self.grads = [p.grad.clone() for g in self.param_groups for p in g["params"]]
        return super().step(closure)


def tiny_model(seed: int = 0) -> Llama:
    model = Llama(TINY)
    init_weights(model, seed)
    return model


def batch(n: int = 4, seq: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    data = torch.randint(0, TINY.vocab_size, (n, seq + 1), generator=torch.Generator().manual_seed(0))
    return data[:, :-1], data[:, 1:]


def global_norm(tensors: list[torch.Tensor]) -> float:
    return math.sqrt(sum(float(t.double().pow(2).sum()) for t in tensors))


def test_accumulated_micro_batches_equal_one_batch() -> None:
    inputs, targets = batch()
    one, two = tiny_model(), tiny_model()
    opt_one, opt_two = RecordingSGD(one.parameters()), RecordingSGD(two.parameters())
    loss_one, norm_one = train_step(one, opt_one, [(inputs, targets)], lr=0.5, grad_clip=0.0)
    loss_two, norm_two = train_step(two, opt_two, [(inputs[:2], targets[:2]), (inputs[2:], targets[2:])],
                                    lr=0.5, grad_clip=0.0)
    torch.testing.assert_close(loss_two, loss_one, rtol=0, atol=1e-6)
    torch.testing.assert_close(norm_two, norm_one, rtol=1e-6, atol=1e-6)
    assert len(opt_one.grads) == len(opt_two.grads) > 0
    for g1, g2 in zip(opt_one.grads, opt_two.grads, strict=True):
        torch.testing.assert_close(g2, g1, rtol=0, atol=1e-6)
    assert max(float(g.abs().max()) for g in opt_one.grads) > 1e-4  # the gradients are not trivially zero
    for p1, p2 in zip(one.parameters(), two.parameters(), strict=True):
        torch.testing.assert_close(p2, p1, rtol=0, atol=1e-6)
    # The step was taken, at the requested rate, and the gradients were cleared for the next one.
    assert all(g["lr"] == 0.5 for g in opt_one.param_groups)
    assert any(not torch.equal(p, q) for p, q in zip(one.parameters(), tiny_model().parameters(), strict=True))
    assert all(p.grad is None for p in one.parameters())


def test_accumulated_adamw_update_equals_one_batch() -> None:
    inputs, targets = batch()
    one, two = tiny_model(), tiny_model()
    cfg = OptimConfig(lr=1e-3)
    train_step(one, build_optimizer(one, cfg), [(inputs, targets)], lr=1e-3, grad_clip=1.0)
    train_step(two, build_optimizer(two, cfg), [(inputs[:2], targets[:2]), (inputs[2:], targets[2:])],
               lr=1e-3, grad_clip=1.0)
    for (name, p1), p2 in zip(one.named_parameters(), two.parameters(), strict=True):
        torch.testing.assert_close(p2, p1, rtol=0, atol=1e-6, msg=name)


def test_loss_is_the_mean_over_micro_batches() -> None:
    inputs, targets = batch()
    model = tiny_model()
    with torch.no_grad():
        logits = model(inputs)
    expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
    loss, _ = train_step(model, RecordingSGD(model.parameters()), [(inputs[:2], targets[:2]),
                                                                    (inputs[2:], targets[2:])], lr=0.0, grad_clip=0.0)
    torch.testing.assert_close(loss, expected, rtol=0, atol=1e-6)


def test_train_step_clips_to_max_norm() -> None:
    inputs, targets = batch()
    free, clipped = tiny_model(), tiny_model()
    opt_free, opt_clipped = RecordingSGD(free.parameters()), RecordingSGD(clipped.parameters())
    _, norm_free = train_step(free, opt_free, [(inputs, targets)], lr=0.1, grad_clip=0.0)
    max_norm = float(norm_free) / 10
    _, norm = train_step(clipped, opt_clipped, [(inputs, targets)], lr=0.1, grad_clip=max_norm)
    # The reported norm is the one before clipping; the applied gradients are capped.
    torch.testing.assert_close(norm, norm_free)
    assert global_norm(opt_free.grads) == pytest.approx(float(norm_free), rel=1e-5)
    assert global_norm(opt_clipped.grads) <= max_norm * (1 + 1e-5)
    assert global_norm(opt_clipped.grads) == pytest.approx(max_norm, rel=1e-4)
    # Clipping rescales, it does not change the direction.
    for g_free, g_clipped in zip(opt_free.grads, opt_clipped.grads, strict=True):
        torch.testing.assert_close(g_clipped, g_free * (max_norm / float(norm_free)), rtol=1e-4, atol=1e-9)


def _params_with_grads(*grads: list[float]) -> list[torch.nn.Parameter]:
    params = []
    for g in grads:
        p = torch.nn.Parameter(torch.zeros(len(g)))
        p.grad = torch.tensor(g)
        params.append(p)
    return params


def test_grad_norm_and_clip_returns_the_pre_clip_norm() -> None:
    params = _params_with_grads([3.0, 4.0], [12.0])  # global norm 13
    params.append(torch.nn.Parameter(torch.zeros(2)))  # no gradient: ignored
    norm = grad_norm_and_clip(params, max_norm=1.0)
    assert float(norm) == pytest.approx(13.0)
    after = global_norm([p.grad for p in params if p.grad is not None])
    assert after <= 1.0 + 1e-6
    torch.testing.assert_close(params[0].grad, torch.tensor([3.0, 4.0]) / 13, rtol=1e-5, atol=0)
    assert params[2].grad is None


@pytest.mark.parametrize("max_norm", [0.0, 13.5, 100.0])
def test_grad_norm_and_clip_leaves_small_or_unclipped_gradients(max_norm: float) -> None:
    # max_norm 0 disables clipping; a norm under the cap is left exactly as it is.
    params = _params_with_grads([3.0, 4.0], [12.0])
    assert float(grad_norm_and_clip(params, max_norm)) == pytest.approx(13.0)
    assert torch.equal(params[0].grad, torch.tensor([3.0, 4.0])) and torch.equal(params[1].grad, torch.tensor([12.0]))


def test_update_norm_is_the_norm_of_the_change_the_step_made() -> None:
    import torch.distributed as dist

    from keel.train.optim import update_norm_sq

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
        optimizer = build_optimizer(model, OptimConfig(lr=1e-2, weight_decay=0.1))
        assert float(update_norm_sq([optimizer])) == 0.0, "no update yet"
        for _ in range(3):
            model(torch.randn(5, 4)).square().mean().backward()
            before = [p.detach().clone() for p in model.parameters()]
            optimizer.step()
            optimizer.zero_grad()
            moved = sum(float((p.detach() - b).double().square().sum()) for p, b in zip(model.parameters(), before,
                                                                                      strict=True))
            assert float(update_norm_sq([optimizer])) == pytest.approx(moved, rel=1e-5)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("independent", [False, True])
def test_independent_weight_decay_shrinks_by_the_ratio_to_the_peak_lr(independent: bool) -> None:
    """With no gradient AdamW only decays: by lr·wd per step, or with independent weight decay by
    wd·lr/peak, so that the decay does not move with the peak learning rate."""
    model = torch.nn.Linear(4, 4, bias=False)
    cfg = OptimConfig(lr=1e-2, weight_decay=1e-3 if independent else 0.1, independent_weight_decay=independent)
    optimizer = build_optimizer(model, cfg)
    before = model.weight.detach().clone()
    model.weight.grad = torch.zeros_like(model.weight)
    for group in optimizer.param_groups:
        group["lr"] = cfg.lr / 2  # halfway down the schedule
    optimizer.step()
    shrink = 1 - (cfg.weight_decay / 2 if independent else cfg.lr / 2 * cfg.weight_decay)
    torch.testing.assert_close(model.weight.detach(), before * shrink, rtol=1e-6, atol=0)
