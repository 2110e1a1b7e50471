"""Fault injection specs: each builds its injector, a bad one is a one-line config error, and a bit flip
changes one bit of one element, of a tensor chosen by its index or by its parameter's name."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch

from keel.config import load_config
from keel.core.callbacks import Build
from keel.drill.faults import BitFlip, NanInGradients, PoisonedBatch, SkipUpdateAt, check_injections, parse_injection
from keel.errors import ConfigError
from tests.unit.guard.test_guards import tiny_model_and_optimizer


def test_injection_specs_build_injectors() -> None:
    nan = parse_injection("nan_grads:step=30,rank=1,transient=true")
    assert isinstance(nan, NanInGradients) and (nan.step, nan.rank, nan.transient) == (30, 1, True)
    flip = parse_injection("bitflip:step=4,rank=0,target=exp_avg_sq,tensor=2,element=7,bit=31")
    assert isinstance(flip, BitFlip) and (flip.target, flip.tensor, flip.element, flip.bit) == ("exp_avg_sq", 2, 7, 31)
    named = parse_injection("bitflip:step=4,rank=1,target=params,name=layers.1.moe.experts.w2,element=5")
    assert isinstance(named, BitFlip) and (named.name, named.tensor, named.element) == ("layers.1.moe.experts.w2", 0, 5)
    assert parse_injection("bitflip:step=4,name=*.experts.*").name == "*.experts.*"
    assert isinstance(parse_injection("poison_batch:batch=9"), PoisonedBatch)
    assert isinstance(parse_injection("skip_update:step=3"), SkipUpdateAt)


@pytest.mark.parametrize("spec, message", [
    ("meteor:step=3", "unknown fault 'meteor'"),
    ("bitflip:step=3,target=weights", "bitflip target 'weights'"),
    ("nan_grads:step", "expected key=value"),
    ("nan_grads:when=3", "unexpected keyword"),
])
def test_bad_injection_specs_are_config_errors(spec: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        check_injections(load_config(None, [f'drill.inject=["{spec}"]']).drill.inject)


def test_bit_flip_changes_one_bit_of_one_element() -> None:
    model, optimizer = tiny_model_and_optimizer()
    flip = BitFlip(step=1, rank=0, target="params", tensor=0, element=5, bit=30)
    flip.on_build(Build([model], [optimizer], rank=0, world_size=1, run_dir=Path("."), emit=print, say=print))
    before = model[0].weight.detach().clone()
    flip._flip(model[0].weight)
    changed = (before.view(torch.int32) ^ model[0].weight.detach().view(torch.int32)).view(-1)
    assert changed.count_nonzero() == 1 and changed[5] == 1 << 30


@pytest.mark.parametrize("restart, delivered, held_back", [(1, 1, [2.5]), (0, 1, []), (1, 0, []), (2, 1, [])])
def test_a_killed_group_holds_back_its_restart_after_the_kill_only(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, restart: int, delivered: int, held_back: list) -> None:
    """`down_s` delays the first start after each delivered kill, not the job's first start nor a later one."""
    import keel.drill.faults as faults

    slept: list[float] = []
    monkeypatch.setattr(faults.time, "sleep", slept.append)
    monkeypatch.setattr(faults.dist, "get_rank", lambda: 0)  # rank 0 of a job of its own
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(restart))
    counter = tmp_path / "drill" / "0-kill.delivered"
    counter.parent.mkdir()
    counter.write_text("6\n" * delivered)
    faults.inject("kill:step=6,rank=-1,down_s=2.5", 0, str(tmp_path))
    assert slept == held_back


def test_a_rank_slowed_while_a_group_is_missing_sleeps_only_in_the_steps_without_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, group: None) -> None:
    """Two groups in the quorum, then one (a group lost), then two again (it healed): the sleeps fall in the
    steps made by one group alone."""
    import keel.drill.faults as faults
    from keel.core.callbacks import Step
    from keel.core.replica import PARTICIPANTS
    from keel.core.state import TrainState

    slept: list[int] = []
    slow = faults.inject("slow:rank=-1,seconds=0.5,while_missing=true", 0, str(tmp_path))
    state = TrainState()
    for number, live in enumerate([2, 2, 1, 1, 2, 2], start=1):
        step = Step(number, state, last=False, metrics={PARTICIPANTS: float(live)})
        monkeypatch.setattr(faults.time, "sleep", lambda s, n=number: slept.append(n))
        slow.on_batch(step)
        slow.on_backward(step, replaying=False)
    assert slept == [3, 4]


def expert_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A two-block model whose second block is a mixture of four experts, with one update made (Adam's moments
    exist)."""
    from keel.config import MoEConfig, OptimConfig
    from keel.model.llama import Llama
    from keel.train.optim import build_optimizer
    from tests.unit.model.test_model import TINY, tokens

    torch.manual_seed(0)
    model = Llama(dataclasses.replace(TINY, moe=MoEConfig(experts=4, top_k=2, expert_dim=24, dense_layers=1)))
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    optimizer = build_optimizer(model, OptimConfig())
    model(tokens()).float().square().mean().backward()
    optimizer.step()
    return model, optimizer


def flipped(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> dict[str, list[tuple[int, int]]]:
    """For each tensor that changed: (element, bits changed) of every changed element."""
    out = {}
    for name, old in before.items():
        xor = (old.view(torch.int32) ^ after[name].view(torch.int32)).view(-1)
        if xor.any():
            out[name] = [(int(i), int(xor[i])) for i in xor.nonzero().view(-1)]
    return out


@pytest.mark.parametrize("target", ["params", "exp_avg", "grads"])
def test_a_bit_flip_by_name_lands_in_that_expert_weight_alone(target: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """`name` picks the parameter by a glob over the model's names, `tensor` counts among its matches: element
    5 of the second expert weight of the mixture block (`layers.1.moe.experts.w2`, expert 0's row), and no
    other tensor, changes by exactly the bit asked for."""
    import keel.drill.faults as faults
    from keel.core.callbacks import Step
    from keel.core.state import TrainState

    monkeypatch.setattr(faults.dist, "get_rank", lambda: 1)
    model, optimizer = expert_model()
    flip = BitFlip(step=3, rank=1, target=target, name="*.moe.experts.*", tensor=1, element=5, bit=30)
    flip.on_build(Build([model], [optimizer], rank=1, world_size=2, run_dir=Path("."), emit=print, say=print))
    assert flip.names == ["layers.1.moe.experts.w1", "layers.1.moe.experts.w2", "layers.1.moe.experts.w3"]

    def tensors() -> dict[str, torch.Tensor]:
        named = dict(model.named_parameters())
        of = {"params": lambda p: p, "grads": lambda p: p.grad, "exp_avg": lambda p: optimizer.state[p]["exp_avg"]}
        return {n: of[target](p).detach().clone() for n, p in named.items() if of[target](p) is not None}

    before = tensors()
    state = TrainState(step=3)
    step = Step(3, state, last=False)
    flip.on_backward(step, replaying=False)
    flip.on_step_end(step)
    assert flipped(before, tensors()) == {"layers.1.moe.experts.w2": [(5, 1 << 30)]}
    flip.on_step_end(step)  # once in the run: a step made again is made right
    assert flip.delivered() == 1


@pytest.mark.parametrize("flip, message", [
    (BitFlip(step=3, rank=0, name="layers.9.moe.experts.w1"),
     "bitflip name='layers.9.moe.experts.w1': no parameter of rank 0 matches it; expected a glob over its "
     "parameters' names: tok_embeddings.weight, layers.*.attention_norm.weight, layers.*.attention.wq.weight"),
    (BitFlip(step=3, rank=0, name="*.experts.*", tensor=3),
     "bitflip tensor=3: rank 0 holds 3 parameters named '*.experts.*'; expected a tensor between 0 and 2"),
])
def test_a_bit_flip_beyond_the_parameters_of_its_rank_is_a_config_error(flip: BitFlip, message: str) -> None:
    model, optimizer = expert_model()
    with pytest.raises(ConfigError, match=re.escape(message)):
        flip.on_build(Build([model], [optimizer], rank=0, world_size=2, run_dir=Path("."), emit=print, say=print))
    # On another rank the flip builds without looking (that rank may hold another pipeline stage).
    flip.on_build(Build([model], [optimizer], rank=1, world_size=2, run_dir=Path("."), emit=print, say=print))
