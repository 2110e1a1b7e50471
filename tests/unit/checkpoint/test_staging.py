"""A save's copy runs beside the next step: the checkpoint holds the state of the step it was asked at,
however soon the next update comes, and the first save copies into buffers reserved at start-up without
the optimizer being touched."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

from keel.checkpoint.manager import _FLAT, CheckpointManager, _state_dict, _state_templates
from keel.config import load_config
from keel.core.state import TrainState
from keel.rundir.events import EventLog
from keel.train.optim import build_optimizer


def model_and_optimizer(width: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Linear(width, 8))
    return model, torch.optim.AdamW(model.parameters(), lr=0.5)


def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    inputs = torch.randn(4, model[0].in_features, generator=torch.Generator().manual_seed(1))
    model(inputs).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def manager(tmp_path: Path) -> CheckpointManager:
    cfg = load_config(None, [f"checkpoint.dir={tmp_path / 'ckpt'}", "checkpoint.keep_last=5"])
    return CheckpointManager(cfg, tmp_path, "dp=1", EventLog(tmp_path / "events.jsonl", rank=0))


def snapshot(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    state = _state_dict([model], [optimizer])
    return {f"{g}/{k}": v.clone() for g, part in state.items() for k, v in part.items() if isinstance(v, torch.Tensor)}


def test_an_update_right_after_a_save_waits_for_the_copy_and_the_checkpoint_holds_the_saved_step(
        tmp_path: Path, group: None) -> None:
    # About 200 MB of state: copying it takes long enough that an update not held at the fence would
    # change tensors before they are copied.
    model, optimizer = model_and_optimizer(4096)
    step(model, optimizer)
    saver = manager(tmp_path)
    model(torch.randn(4, 4096)).square().mean().backward()  # the next step's gradients: not part of the state
    expected = snapshot(model, optimizer)
    assert saver.save([model], [optimizer], TrainState(step=1)) == []
    optimizer.step()  # at once, while the copy has only begun
    outcome = saver.finish()
    assert outcome is not None and outcome.committed
    assert outcome.blocking_s > 0
    changed = snapshot(model, optimizer)
    assert any(not torch.equal(changed[k], v) for k, v in expected.items())  # the updates did change the state

    fresh, fresh_optimizer = model_and_optimizer(4096)
    step(fresh, fresh_optimizer)
    step(fresh, fresh_optimizer)  # different values, the same structure
    restored = manager(tmp_path).restore([fresh], [fresh_optimizer], "auto", lambda line: None)
    assert restored is not None and restored[0].step == 1
    loaded = snapshot(fresh, fresh_optimizer)
    assert loaded.keys() == expected.keys()
    assert all(torch.equal(loaded[k], v) for k, v in expected.items())


def test_the_first_save_copies_into_the_buffers_reserved_at_start_and_the_optimizer_is_not_stepped(
        tmp_path: Path, group: None) -> None:
    model, optimizer = model_and_optimizer(32)
    twin, twin_optimizer = model_and_optimizer(32)
    saver = manager(tmp_path)
    saver.reserve([model], [optimizer])
    assert saver.stager._reserving is not None
    saver.stager._reserving.result()
    reserved = {t.data_ptr() for spare in saver.stager.spare.values() for t in spare}
    assert optimizer.state == {}  # probing the optimizer's class did not step this optimizer
    step(model, optimizer)
    step(twin, twin_optimizer)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters(), strict=True))

    saver.save([model], [optimizer], TrainState(step=1), wait=True)
    used = {t.data_ptr() for t in saver.stager.staged.values()}
    tensors = [v for part in _state_dict([model], [optimizer]).values() for v in part.values()
               if isinstance(v, torch.Tensor)]
    assert len(used) == len(tensors) == len(reserved)
    assert used == reserved  # every entry found its buffer among the reserved ones
    assert not any(saver.stager.spare.values())
    # A process that saved ends without joining a thread (keel.core.process.exit_now skips the teardown).
    assert [t.name for t in threading.enumerate() if not t.daemon] == ["MainThread"]


@pytest.mark.parametrize("optimizer_of", ["torch", "keel"])
def test_the_templates_match_what_a_save_stages_entry_for_entry(group: None, optimizer_of: str) -> None:
    model, optimizer = model_and_optimizer(16)
    if optimizer_of == "keel":  # its groups' learning-rate multipliers are not among its defaults
        optimizer = build_optimizer(model, load_config(None, []).optim)
    templates = _state_templates([model], [optimizer])
    step(model, optimizer)
    staged = [v for part in _state_dict([model], [optimizer]).values() for v in part.values()
              if isinstance(v, torch.Tensor)]

    def shapes(tensors: list[torch.Tensor]) -> list[tuple]:
        return sorted((tuple(t.shape), str(t.dtype)) for t in tensors)

    assert shapes(templates) == shapes(staged)
    assert get_optimizer_state_dict(model, optimizer, options=_FLAT)  # the real state exists only after a step
