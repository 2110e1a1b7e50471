"""The training step's objective: a mixture-of-experts model's auxiliary losses enter the gradient as per-sequence
means over the step's sequences, beside the cross entropy's mean over its tokens."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from keel.model.init import init_weights
from keel.model.llama import Llama
from keel.model.moe import Router, Routing, balance_loss, z_loss
from keel.train.step import Stepper
from tests.unit.model.test_model import tokens
from tests.unit.model.test_moe import moe_cfg

BALANCE, Z = 0.1, 0.01


def test_the_auxiliary_losses_are_per_sequence_means_over_every_micro_batch_of_the_step() -> None:
    cfg = moe_cfg(aux_loss_coeff=BALANCE, z_loss_coeff=Z)
    model, reference = Llama(cfg), Llama(moe_cfg())
    init_weights(model, 0)
    init_weights(reference, 0)
    # Two micro-batches of 3 sequences: the step averages over 6 sequences, each micro-batch's loss halved.
    batches = [(tokens(3, 12, seed=s)[:, :-1], tokens(3, 12, seed=s)[:, 1:]) for s in (1, 2)]
    Stepper([model], [], None, grad_clip=0.0, autocast_dtype=None).forward_backward(batches)

    routings: list[Routing] = []
    for router in reference.modules():
        if isinstance(router, Router):
            router.register_forward_hook(lambda _m, _i, out: routings.append(out))
    total = torch.zeros(())
    for inputs, targets in batches:
        routings.clear()
        logits = reference(inputs)
        total = total + F.cross_entropy(logits.flatten(0, 1), targets.flatten()) / len(batches)
        for routing in routings:
            total = total + (BALANCE * balance_loss(routing, 3) + Z * z_loss(routing, 3)) / 6
    total.backward()
    for (name, got), want in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-5, atol=1e-8, msg=name)
    assert model.layers["1"].moe.router.gate.weight.grad is not None


def test_the_auxiliary_losses_move_the_router_and_nothing_before_it_when_off() -> None:
    on, off = Llama(moe_cfg(aux_loss_coeff=BALANCE)), Llama(moe_cfg())
    for model in (on, off):
        init_weights(model, 0)
        Stepper([model], [], None, grad_clip=0.0, autocast_dtype=None).forward_backward(
            [(tokens(2, 12)[:, :-1], tokens(2, 12)[:, 1:])])
    gate = "layers.1.moe.router.gate.weight"
    assert not torch.equal(dict(on.named_parameters())[gate].grad, dict(off.named_parameters())[gate].grad)
