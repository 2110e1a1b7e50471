"""What a model family declares so that keel.parallel can parallelise it without naming its modules: the
blocks it repeats, its tensor-parallel plan, how it computes a share of each sequence (context parallel) and
where its routed experts are (expert parallel).
A new family implements `Parallelizable`; keel.parallel is not edited."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from keel.model.context import ContextParallel
from keel.model.moe import ExpertDispatch


@dataclass(frozen=True)
class ParallelPlan:
    """A tensor-parallel plan in `parallelize_module`'s terms (submodule path → style). `top`: the modules
    outside the blocks, by their path in the model; `block`: what every block applies, by path in the block;
    `by_block`: what some blocks apply besides, by the block's key in `blocks()` (blocks of different kinds, such
    as dense and mixture-of-experts ones). A plan names only modules the model holds (a pipeline stage holds
    some of them)."""

    top: dict[str, ParallelStyle]
    block: dict[str, ParallelStyle]
    by_block: dict[str, dict[str, ParallelStyle]] = field(default_factory=dict)


class Parallelizable(Protocol):
    """A model (an `nn.Module`) that keel.parallel can parallelise: tensor parallel applies its plan;
    activation checkpointing, per-block compile and FSDP work block by block."""

    def blocks(self) -> nn.ModuleDict:
        """The repeated blocks, in the container the forward runs them from: activation checkpointing
        replaces its entries in place."""
        ...

    def parallel_plan(self) -> ParallelPlan:
        """The tensor-parallel plan of the model as it is now (its options, the modules it holds)."""
        ...

    def split_context(self, context: ContextParallel | None) -> None:
        """From now on compute this rank's share of every sequence (`context.positions`), attention through
        `context.attention`; None: whole sequences again."""
        ...

    def split_experts(self, dispatch: ExpertDispatch) -> list[nn.Module]:
        """From now on send the routed experts' rows through `dispatch`, each rank computing its experts' share;
        returns the modules whose parameters (experts first) the caller splits over the expert-parallel ranks
        (none for a dense model)."""
        ...
