"""Memory per device of a training layout: model state, activations, pipeline in-flight micro-batches and
temporary buffers, and whether it fits the accelerator.

Model state follows ZeRO's accounting (Rajbhandari et al. 2020, arXiv 1910.02054, §3.1): mixed-precision
Adam keeps 16 bytes per parameter, 2 (bf16 weights) + 2 (bf16 gradients) + 12 (fp32 master weights, Adam m
and v). FSDP (ZeRO-3) shards all of it over dp_shard; each HSDP replica (dp_replicate) holds a full set of
shards; TP splits every layer's matrices over tp ranks; PP gives each rank its stages' layers, the first
rank also the embedding and the last the final norm and output projection. Ranks differ, so the report is
that of the fuller of the first and the last pipeline rank (as torchtitan reports the maximum over ranks).

Usable memory is the capacity less a runtime reserve: the CUDA context, cuBLAS/cuDNN workspaces and
kernels live outside PyTorch's allocator (taken as 1 GiB), and the caching allocator's reserved
memory exceeds what is allocated by a few percent of the device (fragmentation). Not counted: the
optimizer step's temporaries (foreach AdamW's fp32 scratch the size of the shard), which come after the
backward pass has freed the activations.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

from keel.core.accelerators import Accelerator
from keel.errors import KeelError
from keel.model.llama import ffn_hidden_dim
from keel.plan.layout import Layout, Workload

GIB = 2**30
RUNTIME_RESERVE = 1 * GIB  # CUDA context, library workspaces, kernel images
FRAGMENTATION = 0.05  # share of the device the caching allocator holds beyond what is allocated
NCCL_BUFFERS = 256 * 2**20  # per communicator: NCCL's default 4 MiB per channel, up to 32 channels, send + recv
AC_EVERY = 2  # keel's parallel.ac_every: "selective" checkpoints one block in this many
STATE_BYTES = {"params": 2, "grads": 2, "optimizer": 12}  # per parameter, mixed-precision Adam (ZeRO)


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per device; `headroom` is the unused share of usable memory (negative when it does not fit)."""
    params: float
    grads: float
    optimizer: float
    activations: float
    pipeline_inflight: float
    buffers: float
    total: float
    capacity: float
    usable: float
    headroom: float
    fits: bool
    layout: Layout
    device: str

    def explain(self) -> str:
        parts = sorted(((getattr(self, name), name) for name in
                        ("params", "grads", "optimizer", "activations", "pipeline_inflight", "buffers")), reverse=True)
        largest = ", ".join(f"{name} {value / GIB:.1f}" for value, name in parts[:3] if value > 0)
        verdict = f"fits, {self.headroom:.0%} headroom" if self.fits else "does not fit"
        return (f"{self.total / GIB:.1f} GiB per device at {self.layout.describe()} ({largest}); "
                f"{self.device} has {self.capacity / GIB:.0f} GiB, {self.usable / GIB:.1f} usable: {verdict}")


def block_activations(work: Workload, micro_batch: int, tp: int, sp: bool) -> tuple[float, float]:
    """(bytes one transformer block keeps for its backward pass, bytes it keeps when checkpointed).

    Korthikanti et al. 2022 (arXiv 2205.05198, §4.1) count a GPT block at s·b·h·(34 + 5·a·s/h) bytes in
    16-bit: attention 11sbh + 5as²b (the LayerNorm output feeding QKV, Q and K, V, softmax output and its
    dropout mask, the projection input, a dropout mask), MLP 19sbh (input, GeLU input and output at 4h,
    a dropout mask), LayerNorm inputs 4sbh. keel's Llama block differs, and the count follows it:
      - SDPA runs flash attention: no s² scores are kept (the backward pass recomputes them, which is what
        the paper's "selective recompute" buys, so it is already in this count); it keeps q, k, v, the
        output (which is also wo's input) and an fp32 log-sum-exp per head and position (4·a·s·b).
      - grouped-query attention: k and v have n_kv_heads, 4·r·sbh with r = n_kv_heads / n_heads.
      - RMSNorm runs in fp32 on an up-cast input: CUDA's fused kernel keeps that 4sbh input (and a per-row
        rstd) for each of the two norms. (CPU's composite rms_norm also keeps the normalised fp32 tensor.)
      - no dropout, so no masks.
      - SwiGLU with hidden size f = ffn_hidden_dim (ffn_dim_multiplier, multiple_of): w1 and w3 outputs,
        silu(w1) and the product fed to w2, 4 × 2sbf; the norm outputs fed to wq/wk/wv and w1/w3, 2 × 2sbh.
    Without recompute: (16 + 4r)·sbh + 8·sbf + 4·a·s·b; Llama 3 8B (r = 1/4, f = 3.5h) keeps 45·sbh.
    Tensor parallelism splits heads and FFN columns: those terms are divided by tp. With sequence parallel
    the norm inputs are split along the sequence too (Korthikanti: everything / t), but keel's DTensor
    sequence parallelism all-gathers the inputs of the column-parallel linears and autograd keeps the
    gathered tensors (Megatron keeps the shard and gathers again in the backward pass), so those 4sbh stay
    whole. A checkpointed block keeps only its input: 2sbh (/tp under sequence parallel), as in the paper."""
    m = work.model
    tokens, h, f = work.seq_len * micro_batch, m.dim, ffn_hidden_dim(m)
    r = m.n_kv_heads / m.n_heads
    seq_split = tp if tp > 1 and sp else 1
    norms = 2 * 4 * tokens * h / seq_split
    gathered = 2 * 2 * tokens * h
    split = (tokens * h * (4 + 4 * r) + 8 * tokens * f + 4 * tokens * m.n_heads) / tp
    return norms + gathered + split, 2 * tokens * h / seq_split


def _sizes(work: Workload) -> tuple[int, int]:
    """(parameters per block, parameters of the embedding, which the output projection matches)."""
    m = work.model
    vocab = m.vocab_size * m.dim
    return (work.n_params - vocab * (1 if m.tie_embeddings else 2) - m.dim) // m.n_layers, vocab


def _blocks(work: Workload, layout: Layout) -> int:
    """Blocks on one pipeline rank: v stages of ceil(L / (pp·v)) (the fuller split when L does not divide)."""
    if layout.pp == 1:
        return work.model.n_layers
    return layout.v * math.ceil(work.model.n_layers / (layout.pp * layout.v))


def _stages(work: Workload, layout: Layout) -> list[tuple[float, bool, bool]]:
    """(parameters, holds the embedding, holds the output) of the first and the last pipeline rank. The
    final norm's gains (dim parameters) are left out, as are the blocks' norm gains under TP."""
    if layout.pp == 1:
        return [(work.n_params, True, True)]
    per_block, vocab = _sizes(work)
    params = _blocks(work, layout) * per_block + vocab
    return [(params, True, False), (params, False, True)]


def _inflight(work: Workload, layout: Layout) -> float:
    """Micro-batches of activations the first pipeline rank holds at once. 1F1B: min(m, p); interleaved
    1F1B with v stages per rank: p·(1 + (p−1)/(p·v)) (Korthikanti et al. §4.2.3). m is kept real so that
    a larger micro-batch never lowers the sequences in flight."""
    p = layout.pp
    if p == 1:
        return 1.0
    m = max(1.0, work.global_batch / (layout.dp() * layout.micro_batch))
    return min(m, p + (p - 1) / layout.v if layout.v > 1 else p)


def _rank(work: Workload, layout: Layout, params: float, first: bool, last: bool) -> dict[str, float]:
    m, lay = work.model, layout
    per_block, vocab = _sizes(work)
    local = params / lay.tp  # TP splits the matrices; norms' gains are negligible
    state = {name: local * size / lay.dp_shard for name, size in STATE_BYTES.items()}
    full, ckpt = block_activations(work, lay.micro_batch, lay.tp, lay.sp)
    blocks = _blocks(work, lay)
    checkpointed = {"none": 0, "full": blocks, "selective": math.ceil(blocks / AC_EVERY)}.get(lay.ac)
    if checkpointed is None:
        raise KeelError(f"activation checkpointing {lay.ac!r}: expected none, selective or full")
    kept = checkpointed * ckpt + (blocks - checkpointed) * full
    tokens = work.seq_len * lay.micro_batch
    if last:  # final norm input (fp32) and the output projection's gathered input (bf16)
        kept += 4 * tokens * m.dim / (lay.tp if lay.tp > 1 and lay.sp else 1) + 2 * tokens * m.dim
    # The backward pass of a block holds gradients the size of its activations; a recomputed block
    # materialises its activations once more.
    working = full * (2 if lay.ac != "none" else 1)
    inflight = (_inflight(work, lay) - 1) * kept if first else 0.0
    buffers: float = NCCL_BUFFERS * sum(d > 1 for d in (lay.tp, lay.pp, lay.dp_shard, lay.dp_replicate))
    if last:
        # Logits, vocabulary-sharded over tp: at the loss's backward the bf16 logits (still referenced by
        # the step), the fp32 log-probabilities, their gradient and the gradient of the logits in fp32.
        buffers += (2 + 4 + 4 + 4) * tokens * m.vocab_size / lay.tp
    if lay.dp_shard > 1 and lay.pp > 1:
        # Pipelining defers FSDP's gradient sync to the last micro-batch: the stage stays gathered (bf16)
        # and accumulates unsharded fp32 gradients through the step.
        buffers += local * (2 + 4)
    elif lay.dp_shard > 1:
        # Two blocks gathered in bf16 (current and prefetched) plus the root unit (embedding, norm, output),
        # which FSDP does not reshard after the forward pass; one unit's unsharded gradients in bf16 and in
        # fp32 for the reduce-scatter.
        root = work.n_params - m.n_layers * per_block
        buffers += ((2 * per_block + root) * 2 + max(per_block, vocab) * (2 + 4)) / lay.tp
    return {**state, "activations": kept + working, "pipeline_inflight": inflight, "buffers": buffers}


def usable_bytes(hw: Accelerator) -> float:
    return hw.memory_bytes * (1 - FRAGMENTATION) - RUNTIME_RESERVE


def memory(work: Workload, layout: Layout, hw: Accelerator) -> MemoryBreakdown:
    """Peak bytes per device of training `work` with `layout` on `hw`."""
    if min(layout.tp, layout.pp, layout.v, layout.dp_shard, layout.dp_replicate, layout.micro_batch) < 1:
        raise KeelError(f"layout {layout}: every degree and the micro-batch must be at least 1")
    ranks = [_rank(work, layout, *stage) for stage in _stages(work, layout)]
    parts = max(ranks, key=lambda rank: sum(rank.values()))
    total = sum(parts.values())
    usable = usable_bytes(hw)
    return MemoryBreakdown(**parts, total=total, capacity=hw.memory_bytes, usable=usable,
                           headroom=1 - total / usable if usable > 0 else -math.inf,
                           fits=total <= usable, layout=layout, device=hw.name)


def _moved(layout: Layout, dim: str, factor: int) -> Layout | None:
    """`layout` with `dim` multiplied by `factor`, the GPUs taken from data parallelism (shard first)."""
    for source in ("dp_shard", "dp_replicate"):
        if getattr(layout, source) % factor == 0:
            return replace(layout, **{dim: getattr(layout, dim) * factor,
                                      source: getattr(layout, source) // factor})
    return None


def _candidates(work: Workload, layout: Layout, hw: Accelerator) -> list[Layout]:
    """The obvious fixes, in the order they cost least: more tensor parallelism within a node, activation
    checkpointing, smaller micro-batches, more pipeline stages, all of them together, then more GPUs."""
    m = work.model
    wider: list[Layout] = []
    lay = layout
    while (moved := _moved(lay, "tp", 2)) and moved.tp <= hw.devices_per_node and m.n_kv_heads % moved.tp == 0:
        wider.append(lay := moved)
    out = wider + [replace(layout, ac=ac) for ac in ("selective", "full") if layout.ac == "none" or ac == "full"]
    out += [replace(layout, micro_batch=mb) for mb in range(layout.micro_batch - 1, 0, -1)]
    lay = layout
    while (moved := _moved(lay, "pp", 2)) and moved.pp * moved.v <= m.n_layers:
        out.append(lay := moved)
    out.append(best := replace(wider[-1] if wider else layout, ac="full", micro_batch=1))
    while (moved := _moved(best, "pp", 2)) and moved.pp * moved.v <= m.n_layers:
        out.append(best := moved)
    for _ in range(12):  # up to 4096 times the GPUs
        out.append(best := replace(best, dp_shard=best.dp_shard * 2))
    return [lay for lay in out if lay != layout]


def first_fix(work: Workload, layout: Layout, hw: Accelerator) -> Layout | None:
    """The first of the obvious fixes that fits, or None."""
    return next((lay for lay in _candidates(work, layout, hw) if memory(work, lay, hw).fits), None)


def _change(before: Layout, after: Layout) -> str:
    changed = [f"{f.name}={getattr(after, f.name)}" for f in fields(Layout)
               if getattr(after, f.name) != getattr(before, f.name)]
    if after.gpus() != before.gpus():
        changed.append(f"({after.gpus()} GPUs)")
    return " ".join(changed)


def suggest(work: Workload, layout: Layout, hw: Accelerator) -> str:
    """One line: why `layout` does not fit and the first obvious change that makes it fit."""
    mem = memory(work, layout, hw)
    if mem.fits:
        return mem.explain()
    where = " ".join(f"{name}={getattr(layout, name)}" for name in ("tp", "pp", "dp_shard", "dp_replicate")
                     if getattr(layout, name) > 1) or "one device"
    head = (f"needs {mem.total / GIB:.0f} GiB per device at {where}; {hw.name} has {hw.memory_bytes / GIB:.0f} "
            f"GiB ({mem.usable / GIB:.0f} usable)")
    fix = first_fix(work, layout, hw)
    return f"{head}; try {_change(layout, fix)}" if fix else f"{head}; no layout change found that fits"
