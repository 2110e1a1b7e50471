"""Context parallelism: every sequence split over the N ranks of a context-parallel group, attention exact.

Placement. A sequence of S tokens is cut into 2N chunks of S / 2N; rank r holds chunks r and 2N − 1 − r. Under
causal attention a chunk's queries see all keys before them, so late chunks cost more than early ones; one early
and one late chunk per rank balances the work (the head–tail placement of Megatron-Core and torchtitan).

Attention. Keys and values are all-gathered over the group (the method of Llama 3's context parallelism: with
grouped-query attention K and V are small beside the queries, and one collective per layer replaces N − 1
point-to-point rounds). Each of the rank's two query chunks then attends block by block to the keys it may see:
the keys before the chunk, wholly (or within documents), and the chunk's own keys, causally. Each block gives its
output and the log-sum-exp of its scores; blocks merge as online softmax does, weighting each output by
exp(lse_block − lse_row). A block that the document mask rules out entirely is skipped; rows of a block that it
rules out count for nothing. On a CPU each block is SDPA's flash kernel, elsewhere a plain fp32 computation.

Backward. Only the local K and V are kept: the backward gathers them again (activation memory then falls about as
1/N instead of holding the whole sequence's K and V in every layer), computes each block's gradients from the
row's merged output and log-sum-exp (the flash-attention identity, exact for one block of many), and returns to
each rank the key and value gradients of its positions summed over every rank's queries: a reduce-scatter, which
moves half the bytes of an all-reduce, since each rank needs only its own positions of the sum.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from keel.core.torch_private import flash_attention_cpu, flash_attention_cpu_backward
from keel.errors import ConfigError

Block = tuple[int, int, bool, torch.Tensor | None]  # key start, key end, causal, allowed keys (batch, queries, keys)


class ContextShard:
    """This rank's share of every sequence under context parallelism: the sequence cut into 2N chunks placed
    head–tail, rank r holding chunks r and 2N − 1 − r (N = `size`, r = `rank` in `group`)."""

    def __init__(self, group: dist.ProcessGroup | None, rank: int, size: int) -> None:
        self.group, self.rank, self.size = group, rank, size
        # Asked for by the embedding, the targets, the mask and every layer's backward: made once per length.
        self._positions: dict[tuple[int, str], torch.Tensor] = {}
        self._orders: dict[str, torch.Tensor] = {}  # _rank_order's answer, by device
        self._reach: tuple[tuple, list[bool]] | None = None  # _reaches_back's answer for the documents last seen

    def positions(self, seq_len: int, device: torch.device | None = None) -> torch.Tensor:
        """This rank's positions of a sequence of `seq_len` tokens, ascending."""
        key = (seq_len, str(device))
        if key not in self._positions:
            self._positions[key] = self._place(seq_len, device)
        return self._positions[key]

    def _place(self, seq_len: int, device: torch.device | None) -> torch.Tensor:
        if seq_len % (2 * self.size):
            raise ConfigError(f"train.seq_len = {seq_len} must divide by 2 × parallel.cp = {2 * self.size} (each "
                              f"sequence is cut into 2 × cp chunks, two per context-parallel rank)")
        chunk = seq_len // (2 * self.size)
        return torch.cat([torch.arange(g * chunk, (g + 1) * chunk, device=device) for g in self.chunks()])

    def chunks(self) -> tuple[int, int]:
        return self.rank, 2 * self.size - 1 - self.rank

    def split(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        return x.index_select(dim, self.positions(x.shape[dim], x.device))

    def run_eagerly(self) -> None:
        """Compiled blocks call `attention` as an eager function between their graphs: dynamo does not trace its
        collectives. Marked only when blocks compile, since marking it loads dynamo."""
        self.attention = torch.compiler.disable(self.attention)  # type: ignore[method-assign]

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, query_docs: torch.Tensor | None = None,
                  key_docs: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
        """Causal attention of this rank's queries (batch, heads, local, head_dim) over the whole sequence's keys
        and values, this rank's (batch, kv_heads, local, head_dim) gathered with the others'; within documents
        when given each position's document (`query_docs` (batch, local) and `key_docs` (batch, seq)). Under
        parallel.compile the rest of the block compiles, this runs eagerly between its graphs."""
        out: torch.Tensor = _ContextAttention.apply(q, k, v, query_docs, key_docs, scale, self)
        return out

    # ---------------------------------------------------------------- the group's collectives
    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """(batch, heads, local, d) of every rank → (batch, heads, seq, d) in sequence order."""
        if self.size == 1:
            return local
        parts = [torch.empty_like(local) for _ in range(self.size)]
        dist.all_gather(parts, local.contiguous(), group=self.group)
        half = local.shape[2] // 2
        chunks: list[torch.Tensor] = [local] * (2 * self.size)
        for rank, part in enumerate(parts):
            chunks[rank], chunks[2 * self.size - 1 - rank] = part[:, :, :half], part[:, :, half:]
        return torch.cat(chunks, dim=2)

    def reduce_to_local(self, full: torch.Tensor) -> torch.Tensor:
        """Every rank's (batch, heads, seq, d) summed; this rank's positions of the sum (a reduce-scatter)."""
        if self.size == 1:
            return full
        b, h, seq, d = full.shape
        n, chunk = self.size, seq // (2 * self.size)
        parts = full.view(b, h, 2 * n, chunk, d).index_select(2, self._rank_order(full.device))
        parts = parts.view(b, h, n, 2 * chunk, d)
        mine = torch.empty(b, h, 2 * chunk, d, dtype=full.dtype, device=full.device)
        dist.reduce_scatter_single(mine, parts.movedim(2, 0).reshape(n * b, h, 2 * chunk, d), group=self.group)
        return mine

    def _rank_order(self, device: torch.device) -> torch.Tensor:
        """The 2N chunks as reduce-scatter splits them: rank r's chunks r and 2N − 1 − r side by side, ranks
        outermost. Asked by every layer's backward: made once per device."""
        key = str(device)
        if key not in self._orders:
            n = self.size
            self._orders[key] = torch.tensor([g for r in range(n) for g in (r, 2 * n - 1 - r)], device=device)
        return self._orders[key]

    def blocks(self, chunk: int, g: int, query_docs: torch.Tensor | None,
               key_docs: torch.Tensor | None) -> list[Block]:
        """The key blocks the queries of chunk `g` may see: the keys before it, then its own keys causally; with
        documents, which keys each query may see, and no block that none may."""
        start, end = g * chunk, (g + 1) * chunk
        if query_docs is None or key_docs is None:
            return [*([(0, start, False, None)] if start else []), (start, end, True, None)]
        same = query_docs[:, :, None] == key_docs[:, None, :end]
        causal = torch.ones(chunk, chunk, dtype=torch.bool, device=same.device).tril()
        blocks: list[Block] = []
        if start and self._reaches_back(key_docs, chunk)[g]:
            blocks.append((0, start, False, same[:, :, :start]))
        return [*blocks, (start, end, False, same[:, :, start:] & causal)]

    def _reaches_back(self, key_docs: torch.Tensor, chunk: int) -> list[bool]:
        """Per chunk of the sequence: whether a query of it shares a document with a key before it. Document
        numbers never fall along a sequence, so that is whether a document runs across the chunk's start. Asked
        by every layer, forward and backward, of the same documents: read from the device once per batch."""
        key = (key_docs.data_ptr(), key_docs.shape, key_docs._version, chunk)
        if self._reach is None or self._reach[0] != key:
            starts = torch.arange(chunk, key_docs.shape[1], chunk, device=key_docs.device)
            across = (key_docs[:, starts - 1] == key_docs[:, starts]).any(0)
            self._reach = key, [False, *across.tolist()]
        return self._reach[1]


class _ContextAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_docs: torch.Tensor | None,
                key_docs: torch.Tensor | None, scale: float | None, shard: ContextShard) -> torch.Tensor:
        keys, values = shard.gather(k), shard.gather(v)
        chunk = q.shape[2] // 2
        outs, lses = [], []
        for j, g in enumerate(shard.chunks()):
            rows = slice(j * chunk, (j + 1) * chunk)
            docs = None if query_docs is None else query_docs[:, rows]
            out, lse = None, None
            for first, last, causal, allowed in shard.blocks(chunk, g, docs, key_docs):
                part, part_lse = _block_forward(q[:, :, rows], keys[:, :, first:last], values[:, :, first:last],
                                                causal, allowed, scale)
                out, lse = (part.float(), part_lse) if out is None or lse is None else _merge(out, lse, part, part_lse)
            assert out is not None and lse is not None  # every chunk has its own block
            outs.append(out.to(q.dtype))
            lses.append(lse)
        out, lse = torch.cat(outs, dim=2), torch.cat(lses, dim=2)
        ctx.save_for_backward(q, k, v, out, lse, query_docs, key_docs)
        ctx.scale, ctx.shard = scale, shard
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, out, lse, query_docs, key_docs = ctx.saved_tensors
        shard: ContextShard = ctx.shard
        keys, values = shard.gather(k), shard.gather(v)
        dq = torch.zeros_like(q, dtype=torch.float32)
        dkeys, dvalues = torch.zeros_like(keys, dtype=torch.float32), torch.zeros_like(values, dtype=torch.float32)
        chunk = q.shape[2] // 2
        for j, g in enumerate(shard.chunks()):
            rows = slice(j * chunk, (j + 1) * chunk)
            docs = None if query_docs is None else query_docs[:, rows]
            for first, last, causal, allowed in shard.blocks(chunk, g, docs, key_docs):
                cols = slice(first, last)
                dq_b, dk_b, dv_b = _block_backward(grad[:, :, rows].contiguous(), q[:, :, rows], keys[:, :, cols],
                                                   values[:, :, cols], out[:, :, rows], lse[:, :, rows], causal,
                                                   allowed, ctx.scale)
                dq[:, :, rows] += dq_b
                dkeys[:, :, cols] += dk_b
                dvalues[:, :, cols] += dv_b
        dk, dv = shard.reduce_to_local(dkeys), shard.reduce_to_local(dvalues)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def _merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Online softmax: two partial results over disjoint keys as one (a row a block ruled out has lse −inf)."""
    total = torch.logaddexp(lse, block_lse)
    merged = out * (lse - total).exp()[..., None] + block_out.float() * (block_lse - total).exp()[..., None]
    return merged, total


def _additive(allowed: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """(batch, queries, keys) allowed → (batch, 1, queries, keys) 0 / −inf, as the kernels add it."""
    if allowed is None:
        return None
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, float("-inf"))[:, None]


def _block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, allowed: torch.Tensor | None,
                   scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's attention output and log-sum-exp (fp32) per query row."""
    mask = _additive(allowed, q.dtype)
    if q.device.type == "cpu":
        out, lse = flash_attention_cpu(q, k, v, causal, mask, scale)
    else:
        out, lse = _math_forward(q, k, v, causal, mask, scale)
    if allowed is not None:  # rows the mask rules out entirely weigh nothing in the merge
        none = ~allowed.any(-1)[:, None, :]
        out, lse = out.masked_fill(none[..., None], 0.0), lse.float().masked_fill(none, float("-inf"))
    return out, lse.float()


def _block_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, causal: bool, allowed: torch.Tensor | None, scale: float | None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    mask = _additive(allowed, q.dtype)
    if q.device.type == "cpu":
        return flash_attention_cpu_backward(grad, q, k, v, out, lse, causal, mask, scale)
    return _math_backward(grad, q, k, v, out, lse, causal, mask, scale)


def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool, mask: torch.Tensor | None,
            scale: float | None) -> tuple[torch.Tensor, torch.Tensor, float]:
    """fp32 scores (batch, heads, queries, keys), and the keys expanded to the queries' heads."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    keys = k.float().repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scores = q.float() @ keys.transpose(-1, -2) * scale
    if causal:
        scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
    return (scores if mask is None else scores + mask.float()), keys, scale


def _math_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, mask: torch.Tensor | None,
                  scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    scores, _, _ = _scores(q, k, causal, mask, scale)
    lse = torch.logsumexp(scores, dim=-1)
    values = v.float().repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    probs = (scores - lse[..., None]).exp().nan_to_num(0.0)
    return (probs @ values).to(q.dtype), lse


def _math_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, causal: bool, mask: torch.Tensor | None, scale: float | None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of one block from the row's whole output and log-sum-exp: P = exp(S − lse), dV = Pᵀ dO,
    dS = P ∘ (dO Vᵀ − rowsum(dO ∘ O)), dQ = dS K · scale, dK = dSᵀ Q · scale (heads summed per kv head)."""
    scores, keys, scale = _scores(q, k, causal, mask, scale)
    group = q.shape[1] // k.shape[1]
    values = v.float().repeat_interleave(group, dim=1)
    probs = (scores - lse[..., None]).exp()
    g = grad.float()
    dv = probs.transpose(-1, -2) @ g
    ds = probs * (g @ values.transpose(-1, -2) - (g * out.float()).sum(-1, keepdim=True))
    dq = ds @ keys * scale
    dk = ds.transpose(-1, -2) @ q.float() * scale

    def per_kv_head(x: torch.Tensor) -> torch.Tensor:
        return x.unflatten(1, (k.shape[1], group)).sum(2)

    return dq, per_kv_head(dk), per_kv_head(dv)
