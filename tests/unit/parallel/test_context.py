"""Context parallelism's pieces on one process: the head–tail placement of a rank's positions, the one-line error
for a sequence that does not split, the plain fp32 block kernel (used off the CPU) against SDPA's CPU flash kernel,
forward and backward, and the one-rank attention against SDPA, causal and within documents."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from keel.core.torch_private import flash_attention_cpu, flash_attention_cpu_backward
from keel.errors import ConfigError
from keel.parallel.context import ContextShard, _additive, _math_backward, _math_forward


def test_each_rank_holds_one_early_and_one_late_chunk() -> None:
    held = [ContextShard(None, rank, 4).positions(16).tolist() for rank in range(4)]
    assert held == [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]
    assert sorted(p for rank in held for p in rank) == list(range(16))
    x = torch.arange(32).view(2, 16)
    assert ContextShard(None, 1, 4).split(x).tolist() == [[2, 3, 12, 13], [18, 19, 28, 29]]
    with pytest.raises(ConfigError, match=r"^train.seq_len = 20 must divide by 2 × parallel.cp = 8 \(each"):
        ContextShard(None, 0, 4).positions(20)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("masked", [False, True])
def test_the_plain_kernel_matches_the_cpu_flash_kernel(causal: bool, masked: bool) -> None:
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 4, 8, 16, generator=g), torch.randn(2, 2, 8, 16, generator=g), torch.randn(2, 2, 8, 16,
                                                                                                        generator=g)
    allowed = torch.rand(2, 8, 8, generator=g) > 0.3 if masked else None
    if allowed is not None:
        allowed[:, :, 0] = True  # every row keeps a key: the kernels differ on rows with none (keel handles those)
    mask = _additive(allowed, q.dtype)
    out, lse = flash_attention_cpu(q, k, v, causal, mask, 0.5)
    plain_out, plain_lse = _math_forward(q, k, v, causal, mask, 0.5)
    assert torch.allclose(out, plain_out, atol=1e-6) and torch.allclose(lse, plain_lse, atol=1e-6)
    grad = torch.randn(out.shape, generator=g)
    for flash, plain in zip(flash_attention_cpu_backward(grad, q, k, v, out, lse, causal, mask, 0.5),
                            _math_backward(grad, q, k, v, out, lse, causal, mask, 0.5), strict=True):
        assert flash.shape == plain.shape and torch.allclose(flash, plain, atol=1e-5)


@pytest.mark.parametrize("documents", [False, True])
def test_one_rank_attends_as_sdpa(documents: bool) -> None:
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 32, 8, generator=g, requires_grad=True)
    k = torch.randn(2, 2, 32, 8, generator=g, requires_grad=True)
    v = torch.randn(2, 2, 32, 8, generator=g, requires_grad=True)
    docs = (torch.randint(0, 6, (2, 32), generator=g) == 0).cumsum(-1) if documents else None
    shard = ContextShard(None, 0, 1)
    out = shard.attention(q, k, v, query_docs=docs, key_docs=docs)
    index = torch.arange(32)
    mask = None if docs is None else ((docs[:, :, None] == docs[:, None, :]) & (index[None] <= index[:, None]))[:, None]
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True)
    assert torch.allclose(out, want, atol=1e-6)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    for got, expected in zip(grads, torch.autograd.grad(want.square().sum(), (q, k, v)), strict=True):
        assert torch.allclose(got, expected, atol=1e-5)


def test_a_block_of_earlier_keys_is_kept_exactly_when_a_document_runs_into_the_chunk() -> None:
    """The block plan reads once per batch whether a document crosses each chunk start; it keeps the same blocks
    as asking every query whether any earlier key is of its document: documents that begin exactly at chunk
    starts, inside chunks, one over the whole sequence, each alone and all in one batch."""
    size, seq = 4, 32
    chunk = seq // (2 * size)
    starts = torch.zeros(3, seq, dtype=torch.bool)
    starts[0, [0, 4, 8, 16, 24]] = True  # every document begins at a chunk start: no block reaches back
    starts[1, [0, 6, 13]] = True  # documents run across some chunk starts
    starts[2, 0] = True  # one document over the whole sequence
    kept = []
    for docs in (*starts.cumsum(-1)[:, None], starts.cumsum(-1)):
        for rank in range(size):
            shard = ContextShard(None, rank, size)
            mine = docs[:, shard.positions(seq)]
            for j, g in enumerate(shard.chunks()):
                queries, start = mine[:, j * chunk:(j + 1) * chunk], g * chunk
                plan = [(first, last) for first, last, _, _ in shard.blocks(chunk, g, queries, docs)]
                reaches = start > 0 and bool((queries[:, :, None] == docs[:, None, :start]).any())
                assert plan == [*([(0, start)] if reaches else []), (start, start + chunk)], (docs, rank, g)
                kept.append(reaches)
    assert any(kept) and not all(kept)
