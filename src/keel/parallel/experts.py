"""Expert parallelism: a mixture-of-experts layer's routed experts split over the ranks of an expert-parallel
group, each holding `experts / ep` of them, and every token's rows sent to the rank of its expert and back by
all-to-all.

A rank sorts its (token, expert) rows by expert, so the rows for the experts of group rank j are one contiguous
run: the exchange's splits are sums of the counts per expert. The counts go first (one small all-to-all), so that
every rank knows how many rows it receives from each peer for each of its experts; the rows arrive grouped by
sender, then by expert, and are regrouped by expert for the grouped GEMM. The combine is the same exchange
reversed. Both exchanges differentiate into each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from keel.model.moe import permute_rows, sort_by


class AllToAll(torch.autograd.Function):
    """all_to_all_single over rows with uneven splits; its gradient is the reverse exchange."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, received: list[int], sent: list[int], group: Any) -> torch.Tensor:
        ctx.received, ctx.sent, ctx.group = received, sent, group
        return exchange_rows(x, received, sent, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return exchange_rows(grad, ctx.sent, ctx.received, ctx.group), None, None, None


def exchange_rows(x: torch.Tensor, received: list[int], sent: list[int], group: Any) -> torch.Tensor:
    out = x.new_empty(sum(received), *x.shape[1:])
    dist.all_to_all_single(out, x.contiguous(), received, sent, group=group)
    return out


@dataclass(frozen=True)
class Exchange:
    """What the combine needs to undo a dispatch: the rows sent to and received from each peer, and the
    permutation that regrouped the received rows by expert."""

    sent: list[int]
    received: list[int]
    order: torch.Tensor
    inverse: torch.Tensor


class ExpertShard:
    """This rank's part of an expert-parallel group: `keel.model.moe.ExpertDispatch` over all-to-all."""

    def __init__(self, mesh: DeviceMesh) -> None:
        self.group, self.size = mesh.get_group(), int(mesh.size())

    def dispatch(self, x: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Exchange]:
        local_experts = counts.shape[0] // self.size
        incoming = torch.empty_like(counts)  # from each peer in turn, its counts for this rank's experts
        dist.all_to_all_single(incoming, counts.contiguous(), group=self.group)
        incoming = incoming.view(self.size, local_experts)
        # The splits are sizes on the host: the exchange of rows cannot be issued without them.
        sent = counts.view(self.size, local_experts).sum(1).tolist()
        received = incoming.sum(1).tolist()
        rows = AllToAll.apply(x, received, sent, self.group)
        experts = torch.arange(local_experts, device=x.device).repeat(self.size)
        order, inverse = sort_by(torch.repeat_interleave(experts, incoming.flatten(), output_size=rows.shape[0]))
        return permute_rows(rows, order, inverse), incoming.sum(0), Exchange(sent, received, order, inverse)

    def combine(self, out: torch.Tensor, exchange: Exchange) -> torch.Tensor:
        out = permute_rows(out, exchange.inverse, exchange.order)
        result: torch.Tensor = AllToAll.apply(out, exchange.sent, exchange.received, self.group)
        return result


def shard_experts(modules: list[nn.Module], mesh: DeviceMesh) -> None:
    """Split every parameter of `modules` (experts first) along dimension 0 over the expert-parallel mesh."""
    for module in modules:
        for name, param in list(module.named_parameters(recurse=False)):
            sharded = distribute_tensor(param.detach(), mesh, [Shard(0)], src_data_rank=None)
            setattr(module, name, nn.Parameter(sharded, requires_grad=param.requires_grad))
