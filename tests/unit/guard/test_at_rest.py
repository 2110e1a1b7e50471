"""The at-rest check of one process: what each step's seal covers, and what a flip between two updates shows."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from keel.config import GuardConfig, OptimConfig
from keel.guard.sdc import SdcGuard
from keel.parallel.degrees import Degrees
from keel.parallel.layout import Layout
from keel.train.optim import build_optimizer


def guard_for(every: int) -> tuple[SdcGuard, torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 4))
    optimizer = build_optimizer(model, OptimConfig())
    cfg = GuardConfig()
    cfg = dataclasses.replace(cfg, sdc=dataclasses.replace(cfg.sdc, at_rest_interval=1, at_rest_moments_every=every))
    layout = Layout.build("cpu", Degrees(dp_replicate=1, dp_shard=1, tp=1))
    names = {p: n for n, p in model.named_parameters()}
    return SdcGuard(cfg, layout, [optimizer], list(model.parameters()), True, names), model, optimizer


def update(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.randn(8, 16)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def flip(tensor: torch.Tensor, bit: int) -> None:
    tensor.view(-1).view(torch.int32)[0] ^= 1 << bit


def sealed_names(guard: SdcGuard) -> set[str]:
    from keel.guard.sdc import tensor_names

    assert guard.sealed is not None
    names = tensor_names(guard.optimizers, guard.names)
    return {names[i] for i in guard.sealed[1]}


def test_parameters_are_sealed_every_step_and_the_optimizer_state_in_turns_of_even_bytes(group: None) -> None:
    guard, model, optimizer = guard_for(every=4)
    update(model, optimizer)
    params = {n for n, _ in model.named_parameters()}
    state: set[str] = set()
    for step in range(1, 5):
        guard.seal(step)
        names = sealed_names(guard)
        assert params <= names
        turn = names - params
        assert turn and not turn & state  # each turn holds state no other turn did
        state |= turn
    everything = {f"{p}/{k}" for p in params for k in ("exp_avg", "exp_avg_sq", "step")}
    assert state == everything
    weights = [sum(t.numel() * t.element_size() for t, turn in zip(guard.watched, guard.turns, strict=True)
                   if turn == k) for k in range(4)]
    assert max(weights) - min(weights) <= max(t.numel() * t.element_size() for t in guard.watched)
    guard.seal(5, force=True)  # after a restore, rollback or heal: all of it
    assert sealed_names(guard) == params | everything


@pytest.mark.parametrize("every", [1, 4])
def test_a_flip_at_rest_is_found_and_named_when_its_tensor_was_sealed(group: None, every: int) -> None:
    guard, model, optimizer = guard_for(every)
    params = dict(model.named_parameters())
    update(model, optimizer)
    guard.seal(1)
    assert float(guard.changed_at_rest(2, torch.device("cpu"))) == 0
    caught = {"0.weight": 0, "2.bias/exp_avg_sq": 0}
    for step in range(2, 6):
        update(model, optimizer)
        guard.seal(step)
        for name in caught:
            param = params[name.split("/")[0]]
            tensor = optimizer.state[param][name.split("/")[1]] if "/" in name else param.data
            flip(tensor, 22)
            changed = float(guard.changed_at_rest(step + 1, torch.device("cpu")))
            assert changed == (1 if name in sealed_names(guard) else 0)
            if changed:
                caught[name] += 1
                action = guard.at_rest(step + 1)
                assert action.kind == "quarantine" and action.ranks == (0,) and action.to_step == step
                assert action.evidence["tensors"] == {0: [name]}
            flip(tensor, 22)  # undone
    assert caught == {"0.weight": 4, "2.bias/exp_avg_sq": 4 // every}  # a parameter every step, state in its turn


def test_a_step_that_was_not_sealed_is_not_checked(group: None) -> None:
    guard, model, optimizer = guard_for(every=1)
    update(model, optimizer)
    guard.seal(1)
    flip(next(model.parameters()).data, 0)
    assert float(guard.changed_at_rest(3, torch.device("cpu"))) == 0  # the seal was of step 1, not 2
