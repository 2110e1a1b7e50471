"""Context-parallel attention is exact: on 2 and 4 gloo processes, each rank's output and the gradients of its
queries, keys and values equal the one-process SDPA over the whole sequence, causal and within documents
(documents across chunk boundaries, tokens before any document start, a document at position 0), with grouped-query
heads and a given or default scale."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from keel.parallel.context import ContextShard
from tests.conftest import free_port

pytestmark = pytest.mark.dist

CASES = [(seq, documents, scale) for seq in (64, 256) for documents in (False, True) for scale in (None, 0.3)]


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: torch.Tensor | None,
              scale: float | None) -> torch.Tensor:
    if docs is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, scale=scale)
    index = torch.arange(q.shape[2])
    mask = (docs[:, :, None] == docs[:, None, :]) & (index[None, :] <= index[:, None])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], enable_gqa=True, scale=scale)


def documents(seq: int, g: torch.Generator) -> torch.Tensor:
    """Document ids: row 0 starts a document at position 0, row 1 has tokens before its first start."""
    starts = torch.rand(2, seq, generator=g) < 0.06
    starts[0, 0], starts[1, :5] = True, False
    return starts.cumsum(-1)


def worst_error(shard: ContextShard, seq: int, with_documents: bool, scale: float | None) -> float:
    g = torch.Generator().manual_seed(seq)
    q, k, v = torch.randn(2, 4, seq, 8, generator=g), torch.randn(2, 2, seq, 8, generator=g), \
        torch.randn(2, 2, seq, 8, generator=g)
    grad = torch.randn(2, 4, seq, 8, generator=g)
    docs = documents(seq, g) if with_documents else None
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    want = reference(*whole, docs, scale)
    want.backward(grad)
    mine = [shard.split(t, dim=2).clone().requires_grad_() for t in (q, k, v)]
    out = shard.attention(*mine, query_docs=None if docs is None else shard.split(docs), key_docs=docs, scale=scale)
    out.backward(shard.split(grad, dim=2))
    pairs = [(out, want), *((m.grad, w.grad) for m, w in zip(mine, whole, strict=True))]
    return max((got - shard.split(expected, dim=2)).abs().max().item() for got, expected in pairs)


def _worker(rank: int, size: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    dist.init_process_group("gloo", rank=rank, world_size=size)
    try:
        shard = ContextShard(dist.group.WORLD, rank, size)
        errors = torch.tensor([worst_error(shard, *case) for case in CASES])
        dist.all_reduce(errors, op=dist.ReduceOp.MAX)
        if rank == 0:
            torch.save(errors, out)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("size", [2, 4])
def test_every_ranks_share_of_attention_and_its_gradients_equal_one_process(size: int, tmp_path: Path) -> None:
    out = tmp_path / "errors.pt"
    mp.start_processes(_worker, args=(size, free_port(), str(out)), nprocs=size, join=True, start_method="spawn")
    errors = torch.load(out)
    assert len(errors) == len(CASES) and bool((errors < 1e-5).all()), dict(zip(CASES, errors.tolist(), strict=True))
    print(f"cp={size}: largest difference {errors.max().item():.2e}")
