"""Expert parallelism, parallel.ep: a mixture-of-experts model's routed experts split over ep ranks borrowed from
dp_shard × cp (keel.parallel.experts): no dimension of the mesh of its own, and so no factor of the world size.
Each ep consecutive ranks of dp_shard × cp split the experts; the ranks left over shard each expert group with
FSDP (`Layout.experts`)."""

from __future__ import annotations

import math
from typing import Any

from keel.config import Config, ParallelConfig, option
from keel.errors import ConfigError
from keel.parallel.degrees import Degrees, degree


def check_config(cfg: Config, ep: int) -> None:
    """The model has experts to split, as many on every rank."""
    experts = cfg.model.moe.experts
    if not experts and ep > 1:
        raise ConfigError(f"parallel.ep = {ep} splits routed experts, but the model has none "
                          f"(model.moe.experts = 0); set parallel.ep = 1 or give the model experts")
    if experts and experts % ep:
        raise ConfigError(f"model.moe.experts = {experts} must divide by parallel.ep = {ep}: each "
                          f"expert-parallel rank holds the same number of experts")


def check(cfg: Config, degrees: Degrees) -> None:
    """Its ranks are borrowed from the ranks that shard the parameters: it divides them."""
    if math.prod(degrees.of(dim) for dim in EP.borrows) % degrees.ep:
        lenders = [dim for dim in EP.borrows if dim == "dp_shard" or degrees.of(dim) > 1]
        lender = f"{' × '.join(lenders)} = {' × '.join(str(degrees.of(dim)) for dim in lenders)}"
        raise ConfigError(f"parallel.ep = {degrees.ep} must divide {lender}: the expert-parallel ranks are borrowed "
                          f"from the ranks that shard the parameters")


def split_experts(model: Any, layout: Any, cfg: ParallelConfig) -> list[tuple[Any, Any]]:
    """The model sends its routed experts' rows over all-to-all (`Layout.ep`) and holds its share of their
    weights, which FSDP shards further over `Layout.expert_fsdp`."""
    from keel.parallel.experts import ExpertShard, shard_experts  # torch, only where a model is parallelised

    experts = model.split_experts(ExpertShard(layout.ep))
    shard_experts(experts, layout.ep)
    return [(module, layout.expert_fsdp) for module in experts]


EP = degree(
    "ep", option(1, "expert-parallel degree: a mixture-of-experts model's routed experts split over this many "
                 "ranks, borrowed from dp_shard × cp (it divides their product); tokens reach their experts by "
                 "all-to-all, and the experts are FSDP-sharded over the data-parallel ranks left over", ge=1),
    borrows=("dp_shard", "cp"), splits="experts",
    check_config=check_config, check=check, apply=split_experts, hook="split_experts")
