"""A step's compute from its kernels: every matrix multiply at an efficiency set by its shape, the attention at
its kernel's, and the element-wise and normalisation kernels at the memory bandwidth, each as the trainer runs
it (`Software`: eager PyTorch, compiled, Transformer Engine, attention scores materialised).

GEMMs. A GEMM of M×K by K×N is cut into output tiles (`Kernels.tile`), spread over the device's compute units
(SMs) in waves; each tile loops over K. Its time is the largest of:
- its FLOPs at `gemm` of the dtype's dense peak (the best a brute-force shape search reaches: [ME]'s MAMF
  table), less the tiles' padding past M and N (tile quantisation; a side shorter than the tile gets the next
  power of two from 16), the idle units of the last wave (wave
  quantisation) and each tile's fixed start and finish, worth `Kernels.k_overhead` of its loop over K;
- its operands and result moved once through memory at `memory` of the bandwidth (small or thin GEMMs).
A grouped GEMM (the routed experts of a rank, one kernel) spreads every group's tiles over the units at once.
The backward of Y = X·W computes dX = dY·Wᵀ (M×N by N×K) and dW = Xᵀ·dY (K×M by M×N): two GEMMs of its FLOPs.

Attention by the kernel the trainer runs (`Software.attention`): a flash kernel at its share of the bf16 peak
(`Kernels.attention`) forward and backward, for the FLOPs it computes (the causal half of the score tiles:
FlashAttention-2, Dao 2023, §3.1; the backward twice the forward's FLOPs as MFU counts them, its recomputation of
the scores in the efficiency); a materialised one as two batched GEMMs over every score and a softmax that reads
and writes them (`SOFTMAX_BYTES`).

Memory-bound kernels, bytes per token moved through memory (forward; the backward reads and writes about twice
as much, `BACKWARD_BYTES`): the two RMSNorms (read and write the hidden state: 2·2·d) and residual adds (two
reads, a write: 2·3·d), on a 1/tp share of the tokens with sequence parallelism; rotary embeddings of the
queries and keys (read, write); SwiGLU's product (reads the gate and up projections, writes one: 3·f); a
mixture-of-experts block's routing (the router's fp32 scores read and written) and its permutations (each
routed row gathered before the experts and scattered back after: 4·top_k·d); the loss on the last pipeline
rank (the logits written in the activations' dtype, read, and their fp32 softmax and gradient written and
read: `LOSS_BYTES` a logit); the optimizer once per step (AdamW reads the fp32 parameter, gradient and two
moments and writes three: `ADAM_BYTES` a parameter of the rank's shard).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from keel.config import ffn_hidden_dim, head_size
from keel.core.accelerators import Accelerator
from keel.errors import KeelError
from keel.plan.layout import Layout, Software, Workload, rank_block_ids
from keel.plan.memory import act_bytes

BACKWARD_BYTES = 2.0  # memory traffic of an element-wise kernel's backward over its forward's
LOSS_BYTES = 14  # per logit: written (2) and read (2) as bf16, softmax and gradient in fp32 written and read (4+4, 2)
ADAM_BYTES = 28  # per parameter: fp32 parameter, gradient, two moments read (16); parameter and moments written (12)
SOFTMAX_BYTES = 4  # per score of a materialised attention: read and written once more in bf16 by its softmax
# Eager PyTorch runs a norm, a rotary embedding or SwiGLU as two or three kernels (a square and mean, then the
# scale; a SiLU, then the product), each reading and writing its operands: about twice the traffic of the one
# fused kernel Transformer Engine or torch.compile makes of them (an assumption, as `Kernels.memory`'s 0.8).
EAGER_PASSES = 2.0
# The share of the attention FLOPs a causal flash kernel computes: the score tiles below the diagonal.
CAUSAL_SHARE = 0.5


@dataclass(frozen=True)
class Kernels:
    """How close a device's kernels come to its peaks, by accelerator generation (`KERNELS`), each with its
    source. `attention` maps an attention kernel (Software.attention) to its (forward, backward) share of the
    bf16 peak."""

    gemm: float = 1.0  # share of the dense peak of the GEMM's dtype a large GEMM reaches
    gemm_fp8: float = 1.0
    memory: float = 0.80  # share of the memory bandwidth element-wise kernels and thin GEMMs reach
    units: int = 0  # compute units a GEMM's tiles are spread over (SMs); 0: no wave quantisation (not known)
    tile: tuple[int, int] = (1, 1)  # a GEMM's output tile, M × N
    k_overhead: int = 0  # a tile's prologue (first loads) and epilogue (conversion, store), in steps of K
    attention: tuple[tuple[str, tuple[float, float]], ...] = (("fused", (1.0, 1.0)), ("flash2", (1.0, 1.0)))
    source: str = "none: every kernel at the peak (a measured run calibrates the rest)"

    def attention_efficiency(self, kind: str) -> tuple[float, float]:
        return dict(self.attention).get(kind) or dict(self.attention)["fused"]


# The output tile of the large bf16 GEMMs of cuBLAS and CUTLASS on Hopper and Ampere is 128 × 256; a tile's loop
# over K starts by filling its pipeline of loads and ends converting and storing its result, worth about 256 of K.
TILE, K_OVERHEAD = (128, 256), 256
HOPPER_ATTENTION = (("fused", (0.65, 0.50)), ("flash2", (0.35, 0.30)))
KERNELS: dict[str, Kernels] = {  # by `Accelerator.generation`
    "hopper": Kernels(
        0.803, 0.709, 0.80, 132, TILE, K_OVERHEAD, HOPPER_ATTENTION,
        "GEMM: [ME] MAMF H100 SXM, bf16 794.5 and fp8 1,402.6 of 989/1,979 TFLOP/s; attention: FlashAttention-3 "
        "(Shah et al. 2024) causal, head dim 128, 4-16k: ~640 TFLOP/s forward, the backward ~1.5× "
        "FlashAttention-2's, which runs at ~350 and ~300 on H100; 132 SMs"),
    "blackwell": Kernels(
        0.776, 0.763, 0.80, 148, TILE, K_OVERHEAD, HOPPER_ATTENTION,
        "GEMM: [ME] MAMF B200, bf16 1,745 and fp8 3,432.5 of 2,250/4,500 TFLOP/s; attention taken as Hopper's; "
        "148 SMs"),
    "ampere": Kernels(
        0.86, 0.0, 0.80, 108, TILE, K_OVERHEAD, (("fused", (0.65, 0.55)), ("flash2", (0.65, 0.55))),
        "GEMM: large bf16 GEMMs on A100 reach ~270 of 312 TFLOP/s; attention: FlashAttention-2 (Dao 2023), "
        "50-73% of the peak forward, up to 63% backward; 108 SMs"),
}
DEFAULT_KERNELS = Kernels()


def peak_flops(work: Workload, hw: Accelerator) -> float:
    peak = hw.peak_flops.get(work.param_dtype) or hw.peak_flops.get("bf16")
    if not peak:
        raise KeelError(f"{hw.name} has no known {work.param_dtype} peak FLOP/s: measure it (keel train reports "
                        f"it) or calibrate from a run")
    return peak


def float8_peak(hw: Accelerator) -> float:
    peak = hw.peak_flops.get("fp8")
    if not peak:
        raise KeelError(f"train.precision = fp8 on {hw.name}, which has no float8 matmuls: plan it with bf16, or on "
                        f"an accelerator that has them (h100, h200, b200, mi300x, ...)")
    return peak


def kernels_for(hw: Accelerator) -> Kernels:
    return KERNELS.get(hw.generation, DEFAULT_KERNELS)


# A cluster file's own kernel figures (`keel plan --cluster`), by the names `with_figures` takes.
FIGURES = ("gemm", "gemm_fp8", "attention_forward", "attention_backward", "memory")


def with_figures(kern: Kernels, figures: dict[str, float]) -> Kernels:
    """`kern` with a cluster's measured or published figures in place of the generation's (the attention's for
    whichever kernel the trainer runs)."""
    if not figures:
        return kern
    attention = tuple((kind, (figures.get("attention_forward", forward), figures.get("attention_backward", backward)))
                      for kind, (forward, backward) in kern.attention)
    return replace(kern, gemm=figures.get("gemm", kern.gemm), gemm_fp8=figures.get("gemm_fp8", kern.gemm_fp8),
                   memory=figures.get("memory", kern.memory), attention=attention,
                   source=f"the cluster file's {', '.join(sorted(figures))}; otherwise {kern.source}")


def _fitted_tile(side: float) -> int:
    """The tile a library picks along a short side: the next power of two from 16 (a skinny GEMM is not padded to a
    128-row tile)."""
    return max(16, 2 ** math.ceil(math.log2(max(side, 1))))


def gemm_seconds(m: float, n: float, k: float, peak: float, bw: float, kern: Kernels, eff: float,
                 dtype_bytes: float = 2, groups: float = 1) -> float:
    """One GEMM of M×K by K×N (`groups` of them in one grouped or batched kernel) at `eff` of `peak`; its memory
    floor where the bandwidth is known."""
    if m <= 0 or n <= 0 or k <= 0:
        return 0.0
    tile_m, tile_n = (min(tile, _fitted_tile(side)) for tile, side in zip(kern.tile, (m, n), strict=True))
    rows, cols = math.ceil(m / tile_m), math.ceil(n / tile_n)
    tiles = rows * cols * groups
    padding = (m * n) / (rows * tile_m * cols * tile_n)
    waves = tiles / (math.ceil(tiles / kern.units) * kern.units) if kern.units else 1.0
    compute = 2 * m * n * k * groups / (peak * eff * padding * waves * k / (k + kern.k_overhead))
    moved = (m * k + k * n + m * n) * groups * dtype_bytes
    return max(compute, moved / (bw * kern.memory)) if bw > 0 else compute


def trained_gemm_seconds(m: float, n: float, k: float, peak: float, bw: float, kern: Kernels, eff: float,
                         dtype_bytes: float = 2, groups: float = 1, forwards: float = 1.0) -> float:
    """A GEMM Y = X·W of the forward (`forwards` of them: recomputed forwards add) and the two of its backward,
    dX = dY·Wᵀ and dW = Xᵀ·dY."""
    def one(a: float, b: float, c: float) -> float:
        return gemm_seconds(a, b, c, peak, bw, kern, eff, dtype_bytes, groups)

    return forwards * one(m, n, k) + one(m, k, n) + one(k, n, m)


@dataclass(frozen=True)
class _Rank:
    """What a rank's kernels see of a micro-batch."""

    work: Workload
    layout: Layout
    hw: Accelerator
    kern: Kernels
    soft: Software
    forwards: float  # forward passes per micro-batch: 1 + the recomputed share

    @property
    def tokens(self) -> float:
        return self.work.local_tokens(self.layout)

    @property
    def act(self) -> int:
        """Bytes of an activation element."""
        return act_bytes(self.work)

    def linear(self, n: float, k: float, rows: float | None = None, groups: float = 1,
               fp8: bool | None = None, forwards: float | None = None) -> float:
        """A linear layer of `k` inputs and `n` outputs over `rows` (the micro-batch's tokens), trained."""
        use_fp8 = self.work.fp8 if fp8 is None else fp8
        hw, kern = self.hw, self.kern
        peak = float8_peak(hw) if use_fp8 else peak_flops(self.work, hw)
        return trained_gemm_seconds(self.tokens if rows is None else rows, n, k, peak, hw.memory_bw, kern,
                                    kern.gemm_fp8 if use_fp8 else kern.gemm, 1 if use_fp8 else 2, groups,
                                    self.forwards if forwards is None else forwards)

    def moved(self, elements: float) -> float:
        """Element-wise kernels that move `elements` activations a forward, trained; 0 where the bandwidth is not
        known."""
        if self.hw.memory_bw <= 0:
            return 0.0
        passes = 1.0 if self.soft.fused else EAGER_PASSES
        return elements * self.act * passes * (self.forwards + BACKWARD_BYTES) / (self.hw.memory_bw * self.kern.memory)


def _attention(r: _Rank) -> float:
    """A block's attention for one micro-batch: a flash kernel computes the causal half of the scores (the rank's
    queries against the whole sequence under CP); a materialised one computes every score in two batched GEMMs
    (QKᵀ, then the probabilities by V) and writes them out, its softmax reading and writing them once more."""
    m, tp = r.work.model, r.layout.tp
    heads, hd, seq = m.n_heads / tp, head_size(m), r.work.seq_len
    if r.soft.attention == "materialised":
        sequences = r.tokens / seq * r.layout.cp  # a CP rank's queries of a sequence: seq / cp of them
        queries, groups = seq / r.layout.cp, sequences * heads
        # Selective recomputation runs the scores' forward again in the backward, unless the block is anyway.
        forwards = max(r.forwards, 2.0) if r.soft.recomputes_scores else r.forwards
        scores = r.linear(seq, hd, queries, groups, fp8=False, forwards=forwards) + \
            r.linear(hd, seq, queries, groups, fp8=False, forwards=forwards)
        softmax = r.moved(SOFTMAX_BYTES / r.act * queries * seq * groups)
        return scores + softmax * (forwards + BACKWARD_BYTES) / (r.forwards + BACKWARD_BYTES)
    forward, backward = r.kern.attention_efficiency(r.soft.attention)
    flops = 4 * r.tokens * seq * heads * hd * CAUSAL_SHARE
    return flops * (r.forwards / forward + 2 / backward) / peak_flops(r.work, r.hw)


def block_seconds(r: _Rank, layer: int) -> float:
    """One block's kernels for one micro-batch on a rank: its GEMMs, its attention and its memory-bound kernels,
    in the forward, the backward and the recomputed forwards."""
    m, tp, t = r.work.model, r.layout.tp, r.tokens
    hd, d = head_size(m), m.dim
    seconds = r.linear((m.n_heads + 2 * m.n_kv_heads) * hd / tp, d) + r.linear(d, m.n_heads * hd / tp)
    sp_tokens = t / tp if r.layout.sp and tp > 1 else t
    moved = 10 * sp_tokens * d + 2 * t * (m.n_heads + m.n_kv_heads) * hd / tp  # norms, residuals; rotary
    moe = m.moe
    if moe.experts and layer >= moe.dense_layers:
        f = moe.expert_dim or ffn_hidden_dim(m)
        rows = t * moe.top_k * r.layout.ep / moe.experts  # a local expert's rows, the choices spread evenly
        local = moe.experts / r.layout.ep
        seconds += r.linear(moe.experts, d, fp8=False)  # the router
        seconds += r.linear(2 * f, d, rows, local) + r.linear(d, f, rows, local)
        if moe.shared_experts:
            shared = moe.shared_experts * f
            seconds += r.linear(2 * shared, d) + r.linear(d, shared)
        # SwiGLU of every routed and shared row, each routed row gathered and scattered back, the router's scores
        moved += 3 * f * t * (moe.top_k + moe.shared_experts) + 4 * t * moe.top_k * d + 8 * t * moe.experts / r.act
    else:
        width = ffn_hidden_dim(m) / tp
        seconds += r.linear(2 * width, d) + r.linear(d, width)
        moved += 3 * width * t
    return seconds + r.moved(moved) + _attention(r)


def head_seconds(r: _Rank) -> float:
    """The output projection and the loss for one micro-batch on the last pipeline rank (never recomputed)."""
    m = r.work.model
    logits = r.tokens * m.vocab_size / r.layout.tp
    loss = 0.0 if r.hw.memory_bw <= 0 else logits * LOSS_BYTES / (r.hw.memory_bw * r.kern.memory)
    return r.linear(m.vocab_size / r.layout.tp, m.dim, fp8=False, forwards=1.0) + loss


def optimizer_seconds(work: Workload, layout: Layout, hw: Accelerator, kern: Kernels) -> float:
    """AdamW over the rank's share of the parameters (its shard of the optimizer state), once a step."""
    if hw.memory_bw <= 0:
        return 0.0
    experts = sum(work.block_experts)
    local = (work.n_params - experts) / (layout.tp * layout.pp * layout.shard()) \
        + experts / (layout.tp * layout.pp * layout.ep * max(1, layout.expert_shard()))
    return local * ADAM_BYTES / (hw.memory_bw * kern.memory)


def rank_seconds(work: Workload, layout: Layout, hw: Accelerator, kern: Kernels, soft: Software,
                 recompute: float) -> list[float]:
    """Each pipeline rank's kernels for one micro-batch: its blocks and, on the last, the head."""
    r = _Rank(work, layout, hw, kern, soft, 1 + recompute)
    kinds: dict[bool, float] = {}  # a block's time: dense or mixture-of-experts

    def block(layer: int) -> float:
        moe = bool(work.block_experts[layer])
        if moe not in kinds:
            kinds[moe] = block_seconds(r, layer)
        return kinds[moe]

    head = head_seconds(r)
    ranks = rank_block_ids(work.model.n_layers, layout.pp, layout.v)
    return [sum(block(i) for i in ids) + (head if rank == layout.pp - 1 else 0.0) for rank, ids in enumerate(ranks)]


def kernel_seconds(work: Workload, layout: Layout, hw: Accelerator, kern: Kernels, soft: Software,
                   recompute: float) -> float:
    """One step's kernels on the busiest pipeline rank (the pipeline runs at its pace), for every micro-batch, and
    the optimizer."""
    busiest = max(rank_seconds(work, layout, hw, kern, soft, recompute))
    return busiest * work.micro_batches(layout) + optimizer_seconds(work, layout, hw, kern)
