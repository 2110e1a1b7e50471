"""How a pipeline splits the blocks into stages: evenly when it can, else the first and last stages (which also
embed, and run the output and the loss) take fewer."""

from __future__ import annotations

import pytest

from keel.errors import ConfigError
from keel.model.split import stage_blocks, stage_range


@pytest.mark.parametrize("layers, stages, blocks", [
    (32, 4, [8, 8, 8, 8]),
    (126, 16, [7] + [8] * 14 + [7]),  # Llama 3 405B: one block fewer on the first and the last stage
    (70, 12, [5] + [6] * 10 + [5]),  # BLOOM-176B
    (4, 3, [1, 2, 1]),
    (7, 4, [2, 2, 2, 1]),  # more left over than middle stages: the first takes one, the last never
    (5, 2, [3, 2]),
    (4, 4, [1, 1, 1, 1]),
])
def test_blocks_split_evenly_or_with_fewer_on_the_end_stages(layers: int, stages: int, blocks: list[int]) -> None:
    assert stage_blocks(layers, stages) == blocks
    ranges = [stage_range(layers, stages, s) for s in range(stages)]
    assert [i for r in ranges for i in r] == list(range(layers))  # contiguous, in order, each block once


def test_more_stages_than_blocks_is_refused() -> None:
    with pytest.raises(ConfigError, match="3 blocks cannot make 4 pipeline stages"):
        stage_blocks(3, 4)
