"""Which replica groups a fingerprint comparison names: the minority against a majority, every group
when there is none, nobody when all agree."""

from __future__ import annotations

import torch

from keel.train.replicas import disagreeing


def rows(*values: tuple[int, ...]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def test_the_groups_outvoted_by_a_majority_are_named() -> None:
    assert disagreeing(rows((1, 2), (1, 2), (1, 2))) == []
    assert disagreeing(rows((1, 2), (1, 3), (1, 2))) == [1]
    assert disagreeing(rows((5, 2), (1, 2), (1, 2), (1, 2))) == [0]


def test_without_a_majority_every_group_is_suspect() -> None:
    assert disagreeing(rows((1, 2), (1, 3))) == [0, 1]
    assert disagreeing(rows((1,), (2,), (3,))) == [0, 1, 2]
    assert disagreeing(rows((1,), (1,), (2,), (2,))) == [0, 1, 2, 3]
