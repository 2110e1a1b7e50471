"""How a pipeline splits the blocks of a model into stages (one rule, for the trainer and the planner).

When the blocks divide evenly, every stage gets the same number. When they do not, every stage gets
L // S and the L % S blocks left over go to the stages in the middle first: the first stage also embeds
the tokens and the last one runs the final norm, the output projection and the loss, so they are the
ones that take fewer blocks (Llama 3 405B: 126 blocks on 16 stages, 7 on the first and the last and 8 on
the others, arXiv 2407.21783 §3.3.2). Only when more than S − 2 are left over does the first stage take
one more; the last never does.
"""

from __future__ import annotations

from keel.errors import ConfigError


def stage_blocks(n_layers: int, n_stages: int) -> list[int]:
    """Blocks of each of the `n_stages` pipeline stages, in order; every stage holds at least one."""
    if n_stages < 1 or n_layers < n_stages:
        raise ConfigError(f"{n_layers} blocks cannot make {n_stages} pipeline stages of at least one block each; "
                          f"use at most {n_layers} stages (pp × pp_stages_per_rank)")
    base, extra = divmod(n_layers, n_stages)
    blocks = [base] * n_stages
    middle = sorted(range(1, n_stages - 1), key=lambda s: (abs(2 * s - (n_stages - 1)), s))
    for stage in (middle + [0])[:extra]:
        blocks[stage] += 1
    return blocks


def stage_range(n_layers: int, n_stages: int, stage: int) -> range:
    """The indices of the blocks of `stage`."""
    blocks = stage_blocks(n_layers, n_stages)
    start = sum(blocks[:stage])
    return range(start, start + blocks[stage])
