"""The step's one reduction, on a one-process gloo group: the loss, the gradient norm, the non-finite
ranks and every component's named contribution in one report."""

from __future__ import annotations

import pytest
import torch

from keel.core.sync import StepSync


def test_named_contributions_are_read_at_each_reduction(group: None) -> None:
    sync, seen = StepSync(loss_divisor=1), []
    sync.contribute("a", lambda: 2.5)
    sync.contribute("b", lambda: float(len(seen)))
    for number in (1, 2):
        report = sync.reduce(number, torch.tensor(3.0), torch.tensor(4.0), lambda: pytest.fail("asked"))
        seen.append(report)
    assert [r.values for r in seen] == [{"a": 2.5, "b": 0.0}, {"a": 2.5, "b": 1.0}]
    assert (seen[1].step, seen[1].loss, seen[1].grad_norm, seen[1].local_loss) == (2, 3.0, 4.0, 3.0)
    assert seen[1].finite


def test_a_loss_counted_twice_is_divided_and_nonfinite_ranks_are_named(group: None) -> None:
    sync = StepSync(loss_divisor=2)
    assert sync.reduce(1, torch.tensor(3.0), torch.tensor(1.0), lambda: False).loss == 1.5
    report = sync.reduce(2, torch.tensor(float("nan")), torch.tensor(1.0), lambda: True)
    assert report.nonfinite_ranks == [0] and not report.finite


def test_a_name_contributed_twice_is_refused() -> None:
    sync = StepSync(loss_divisor=1)
    sync.contribute("pause/asked", lambda: 0.0)
    with pytest.raises(ValueError, match="'pause/asked' is contributed twice"):
        sync.contribute("pause/asked", lambda: 1.0)


def test_a_value_contributed_on_the_device_joins_the_one_reduction(group: None) -> None:
    sync, devices = StepSync(loss_divisor=1), []
    sync.contribute("host", lambda: 1.0)
    sync.contribute_on_device("device", lambda device: devices.append(device) or torch.tensor(3, device=device))
    report = sync.reduce(1, torch.tensor(2.0), torch.tensor(1.0), lambda: False)
    assert report.values == {"host": 1.0, "device": 3.0} and devices == [torch.device("cpu")]
    with pytest.raises(ValueError, match="'host' is contributed twice"):
        sync.contribute_on_device("host", lambda device: torch.zeros(()))
