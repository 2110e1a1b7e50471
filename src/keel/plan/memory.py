"""Memory per device of a training layout: model state, activations, pipeline in-flight micro-batches and
temporary buffers, and whether it fits the accelerator.

Model state follows ZeRO's accounting (Rajbhandari et al. 2020, arXiv 1910.02054, §3.1): mixed-precision
Adam keeps 16 bytes per parameter, 2 (bf16 weights) + 2 (bf16 gradients) + 12 (fp32 master weights, Adam m
and v). FSDP (ZeRO-3) shards all of it over dp_shard × cp (context-parallel ranks are data-parallel for
the parameters), ZeRO-2 the gradients and optimizer state, ZeRO-1 the optimizer state only (`Layout.zero`);
each HSDP replica (dp_replicate) holds a full set of shards; TP splits every layer's matrices over tp
ranks; PP gives each rank its stages' layers, the first
rank also the embedding and the last the final norm and output projection. Ranks differ, so the report is
that of the fullest pipeline rank (as torchtitan reports the maximum over ranks). A mixture-of-experts
model's state counts every expert: the routed experts are split over ep ranks and sharded over the
dp_shard × cp / ep ranks left over, the same 1 / (dp_shard × cp) of them where they are sharded, and 1 / ep
of them where a rank holds them whole (ZeRO-1/2's parameters, FSDP's gathered units, a pipeline stage's
deferred gradients); its expert blocks keep what keel's experts keep (`moe_activations`).

The peak is that of the backward pass: the model state, the activations kept for it (per block, by
activation checkpointing mode), the micro-batches a pipeline keeps in flight, communication buffers, and
the larger of the two transients that never overlap, the loss's buffers (by `train.cross_entropy`) and a
block's backward. Context parallelism (cp) gives each rank seq_len / cp tokens of every sequence: every
per-token activation, the loss's buffers included, is divided by cp; a block's backward holds the full
sequence's K and V, gathered over the CP group, and their gradients before they are reduced back
(`cp_kv_buffer`). On a CPU the host copies of the state (checkpoint staging, in-memory snapshots) are in
the same memory and count too; in fp32 (keel's CPU default) every state and activation byte count follows
the dtype.

The allocator reserves more than it allocates: freed blocks kept for reuse that the next request does not
fit. That fragmentation is an explicit factor on the peak (`Accelerator.fragmentation`, 5% by default,
`keel plan --fragmentation`; a CUDA run's own is its max reserved over max allocated, less 1). Usable memory
is the capacity less a runtime reserve: the CUDA context, cuBLAS/cuDNN workspaces and kernels live outside
PyTorch's allocator (taken as 1 GiB). The optimizer step adds nothing: AdamW runs fused, in place.

`check_run` compares the model with a keel run's own measured peak (tests/dist/test_memory_model.py:
within ±15% on CPU layouts and sizes, bench/memory_model.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from pathlib import Path

from keel.config import head_size
from keel.core.accelerators import Accelerator, by_key
from keel.errors import KeelError
from keel.model.flops import FUSED_CHUNK, ffn_hidden_dim
from keel.plan.layout import CP_MIN_SEQ, SOFTWARE, Layout, Workload, rank_block_ids, run_layout
from keel.rundir.events import read_jsonl

GIB = 2**30
RUNTIME_RESERVE = 1 * GIB  # CUDA context, library workspaces, kernel images
NCCL_BUFFERS = 256 * 2**20  # per communicator: NCCL's default 4 MiB per channel, up to 32 channels, send + recv
AC_EVERY = 2  # keel's parallel.ac_every: "selective" checkpoints one block in this many
STATE_BYTES = {"params": 2, "grads": 2, "optimizer": 12}  # per parameter, mixed-precision Adam (ZeRO)
GRAD_BUCKET_BYTES = 4  # fp32 gradient bucket of ZeRO-1/2's reducer
# The parts of a device's peak, which add up to it.
PARTS = ("params", "grads", "optimizer", "activations", "pipeline_inflight", "backward", "buffers", "host")


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per device; `headroom` is the unused share of usable memory (negative when it does not fit)."""
    params: float
    grads: float
    optimizer: float
    activations: float
    pipeline_inflight: float
    backward: float
    buffers: float
    host: float
    total: float
    reserved: float  # total and the allocator's fragmentation
    capacity: float
    usable: float
    headroom: float
    fits: bool
    layout: Layout
    device: str

    def explain(self) -> str:
        parts = sorted(((getattr(self, name), name) for name in PARTS), reverse=True)
        largest = ", ".join(f"{name} {value / GIB:.1f}" for value, name in parts[:3] if value > 0)
        verdict = f"fits, {self.headroom:.0%} headroom" if self.fits else "does not fit"
        return (f"{self.total / GIB:.1f} GiB per device at {self.layout.describe()} ({largest}; "
                f"{self.reserved / GIB:.1f} reserved with fragmentation); "
                f"{self.device} has {self.capacity / GIB:.0f} GiB, {self.usable / GIB:.1f} usable: {verdict}")


def act_bytes(work: Workload) -> int:
    """Bytes of an activation element: the compute dtype's (bf16 or fp16: 2; fp32: 4)."""
    return 2 if work.param_dtype in ("bf16", "fp16") else 4


def state_bytes(work: Workload) -> dict[str, int]:
    """Model state per parameter. Mixed precision (ZeRO's accounting, arXiv 1910.02054 §3.1): bf16 weights and
    gradients, fp32 master weights and Adam's m and v (12). fp32 (keel on a CPU): weights, gradients, m, v."""
    return STATE_BYTES if act_bytes(work) == 2 else {"params": 4, "grads": 4, "optimizer": 8}


def block_activations(work: Workload, micro_batch: int, tp: int, sp: bool,
                      composite_norm: bool = False, cp: int = 1, moe: bool = False) -> tuple[float, float]:
    """(bytes one transformer block keeps for its backward pass, bytes it keeps when checkpointed).

    Korthikanti et al. 2022 (arXiv 2205.05198, §4.1) count a GPT block at s·b·h·(34 + 5·a·s/h) bytes in
    16-bit: attention 11sbh + 5as²b (the LayerNorm output feeding QKV, Q and K, V, softmax output and its
    dropout mask, the projection input, a dropout mask), MLP 19sbh (input, GeLU input and output at 4h,
    a dropout mask), LayerNorm inputs 4sbh. keel's Llama block differs, and the count follows it (e bytes an
    element of the compute dtype: 2 in bf16, 4 in fp32):
      - SDPA runs flash attention: no s² scores are kept (the backward pass recomputes them, which is what
        the paper's "selective recompute" buys, so it is already in this count); it keeps q, k, v, the
        output (which is also wo's input) and an fp32 log-sum-exp per head and position (4·a·s·b).
      - grouped-query attention: k and v have n_kv_heads, 2·r·e·sbh with r = n_kv_heads / n_heads (with a
        head size other than h / a, `model.head_dim`, q and the output are a·head_dim wide, k and v
        n_kv_heads·head_dim).
      - RMSNorm runs in fp32 on an up-cast input: CUDA's fused kernel keeps that 4sbh input (and a per-row
        rstd) for each of the two norms; CPU's composite rms_norm (`composite_norm`) also keeps the
        normalised fp32 tensor, 4sbh more per norm.
      - no dropout, so no masks.
      - SwiGLU with hidden size f = ffn_hidden_dim (ffn_dim_multiplier, multiple_of): w1 and w3 outputs,
        silu(w1) and the product fed to w2, 4·e·sbf; the norm outputs fed to wq/wk/wv and w1/w3, 2·e·sbh.
    Without recompute, in bf16: (16 + 4r)·sbh + 8·sbf + 4·a·s·b; Llama 3 8B (r = 1/4, f = 3.5h) keeps 45·sbh.
    Tensor parallelism splits heads and FFN columns: those terms are divided by tp. With sequence parallel
    the norm inputs are split along the sequence too (Korthikanti: everything / t), but keel's DTensor
    sequence parallelism all-gathers the inputs of the column-parallel linears and autograd keeps the
    gathered tensors, so those 2·e·sbh stay whole; Megatron-Core keeps the shard and gathers again in the
    backward pass (`Software.regathers`), and its runs keep 2·e·sbh / tp. A checkpointed block keeps only its input:
    e·sbh (/tp under sequence parallel).
    Context parallelism over cp ranks gives each rank s/cp of every sequence: every term is per token, so all
    are divided by cp; the K and V gathered over the CP group are not kept (the backward pass gathers them
    again: `cp_kv_buffer`). A trainer that materialises the scores (`Software.scores_kept`) keeps
    scores_kept · a·s² bytes a sequence too (Korthikanti's 5as²b with its dropout's mask and output), split by
    tp. A mixture-of-experts block (`moe`) keeps its own feed-forward's (`moe_activations`) in place of the
    SwiGLU's 4·e·sbf and its input's e·sbh."""
    m, e, soft = work.model, act_bytes(work), SOFTWARE[work.software]
    tokens, h, f = work.seq_len * micro_batch / cp, m.dim, ffn_hidden_dim(m)
    q, kv = m.n_heads * head_size(m), m.n_kv_heads * head_size(m)
    seq_split = tp if tp > 1 and sp else 1
    norms = 2 * 4 * tokens * h * (2 if composite_norm else 1) / seq_split
    scores = soft.scores_kept * m.n_heads * work.seq_len * tokens  # a materialised attention's: every query's row
    if moe:  # tp = 1: the planner plans expert blocks without tensor parallelism
        attention = tokens * (2 * q + 2 * kv) * e + 4 * tokens * m.n_heads + scores
        return norms + e * tokens * h + attention + moe_activations(work, tokens), e * tokens * h
    gathered = 2 * e * tokens * h / (seq_split if soft.regathers else 1)
    split = (tokens * (2 * q + 2 * kv) * e + 4 * e * tokens * f + 4 * tokens * m.n_heads + scores) / tp
    return norms + gathered + split, e * tokens * h / seq_split


def moe_activations(work: Workload, tokens: float) -> float:
    """Bytes a mixture-of-experts feed-forward (keel.model.moe) keeps for its backward pass over `tokens`
    tokens, with k of E routed experts per token and S shared experts, each of hidden size H, in width h:
      - the router, in fp32: its up-cast input (4h; in fp32 the input itself), its E scores (a softmax or
        sigmoid keeps its output), and per choice the weights (twice, before and after normalising) and the
        int64 indices of the choice and of the two permutations by expert: 32 bytes;
      - each choice's row of the input, sorted by expert (or, under expert parallelism, received from the
        group: as many rows on average), which the experts' w1 and w3 keep: e·h;
      - each chosen expert's SwiGLU, as the dense one keeps it: 4·e·H;
      - each chosen expert's output, up-cast to fp32 to be weighted by the router's score: 4h;
      - the shared experts' SwiGLU, 4·e·S·H, and their input (the norm's output, e·h), which in fp32 is also
        the router's; without shared experts in bf16 nothing keeps it;
      - the router's weight up-cast to fp32 (4·E·h, once per block, not per token) when the model's is not.
    Tokens are taken as spread evenly over the experts, and the grouped GEMM's padding (16 rows per expert)
    is left out."""
    m, e = work.model, act_bytes(work)
    k, shared, experts = m.moe.top_k, m.moe.shared_experts, m.moe.experts
    hidden, h = m.moe.expert_dim or ffn_hidden_dim(m), m.dim
    upcast = 4 if e < 4 else 0  # the router's fp32 copies of its input and weight
    norm_out = e * h if shared or e == 4 else 0
    per_token = upcast * h + 4 * experts + 32 * k + k * (e * h + 4 * e * hidden + 4 * h) \
        + 4 * e * shared * hidden + norm_out
    return tokens * per_token + upcast * experts * h


def cp_kv_buffer(work: Workload, layout: Layout) -> float:
    """Bytes of a block's context-parallel working set at its backward: the full sequence's K and V, gathered
    over the CP group (2 · s · n_kv_heads · head_dim elements per sequence, the heads split by tp), and their
    gradients at full length before they are reduced back to their ranks. One block's at a time: neither is
    kept for the backward pass. The forward pass holds only the gathered K and V, half of it."""
    if layout.cp == 1:
        return 0.0
    m = work.model
    kv = 2 * work.seq_len * layout.micro_batch * m.n_kv_heads * head_size(m) / layout.tp
    return 2 * act_bytes(work) * kv


def loss_buffer(work: Workload, tokens: float, layout: Layout) -> float:
    """Bytes the loss holds at its backward, the logits sharded over the vocabulary by tp (`keel.model.loss`).
    torch's cross entropy: the fp32 log-probabilities, their gradient and the fp32 gradient of the logits, 12
    bytes per logit; on vocabulary shards (DTensor's loss_parallel) its backward adds the exponentials of the
    log-probabilities, 16; the z-loss keeps the fp32 exponentials of the logits too, 4 more. The logits
    themselves are dropped by the step before the backward, but kept through it by torch's pipeline schedule.
    The fused one: the logits, whose memory then holds their gradient, a log Z per token, and the slices it
    computes in fp32 (one on fp32 logits, two with the up-cast copy of bf16 ones)."""
    logits, e = tokens * work.model.vocab_size / layout.tp, act_bytes(work)
    if work.cross_entropy == "fused":
        return e * logits + (1 if e == 4 else 2) * 4 * min(logits, FUSED_CHUNK) + 4 * tokens
    per_logit = (16 if layout.tp > 1 else 12) + (4 if work.z_loss else 0) + (e if layout.pp > 1 else 0)
    return per_logit * logits


@dataclass(frozen=True)
class Stage:
    """A kind of pipeline rank: its parameters (every expert's), the routed experts' share of them, whether it
    holds the output projection, its blocks, how many of them have experts, and the micro-batches of
    activations it holds at once."""
    params: int
    experts: int
    last: bool
    blocks: int
    moe_blocks: int
    inflight: float


def _stages(work: Workload, layout: Layout) -> set[Stage]:
    """Each distinct kind of pipeline rank (keel.model.split decides its blocks). The final norm's gains (dim
    parameters) are left out, as are the blocks' norm gains under TP.

    A pipeline rank r holds fewer micro-batches in flight the later it is (1F1B: min(m, p) − r), so the first
    rank is taken as the one whose activations peak; with leading dense blocks (DeepSeek-V3's three) the first
    rank that holds expert blocks, whose activations are larger, may peak instead, and it is counted with its
    own micro-batches in flight too. Every other rank is counted with one."""
    experts = work.block_experts
    if layout.pp == 1:
        return {Stage(work.n_params, sum(experts), True, work.model.n_layers, sum(x > 0 for x in experts), 1.0)}
    vocab = work.model.vocab_size * work.model.dim
    ranks = rank_block_ids(work.model.n_layers, layout.pp, layout.v)
    expert_ranks = [rank for rank, ids in enumerate(ranks) if any(experts[i] for i in ids)]
    first_experts = expert_ranks[0] if expert_ranks else 0
    out = set()
    for rank, ids in enumerate(ranks):
        last = rank == layout.pp - 1
        inflight = max(1.0, _inflight(work, layout) - rank) if rank in (0, first_experts) else 1.0
        out.add(Stage(sum(work.block_params[i] for i in ids) + vocab * (rank == 0 or last),
                      sum(experts[i] for i in ids), last, len(ids), sum(experts[i] > 0 for i in ids), inflight))
    return out


def _gathered(lay: Layout, params: float, experts: float) -> float:
    """Parameters of a unit whose routed experts (`experts` of `params`) are split over ep ranks, as FSDP
    gathers them: the experts' share only where the ranks left over shard them (dp_shard × cp / ep > 1)."""
    return params - experts + (experts / lay.ep if lay.expert_shard() > 1 else 0)


def _inflight(work: Workload, layout: Layout) -> float:
    """Micro-batches of activations the first pipeline rank holds at once. GPipe: every one, m (all forwards
    before the backwards); 1F1B: min(m, p); interleaved 1F1B with v stages per rank: p·(1 + (p−1)/(p·v))
    (Korthikanti et al. §4.2.3), and as many with zero bubble (ZB-H1 keeps 1F1B's peak: Qi et al. 2024 §3.1).
    m is kept real so that a larger micro-batch never lowers the sequences in flight."""
    p = layout.pp
    if p == 1:
        return 1.0
    m = max(1.0, work.global_batch / (layout.dp() * layout.micro_batch))
    if layout.pp_schedule() == "gpipe":
        return m
    return min(m, p + (p - 1) / layout.v if layout.v > 1 else p)


def _rank(work: Workload, layout: Layout, stage: Stage, cpu: bool) -> dict[str, float]:
    """One pipeline rank's bytes. On a CPU, rms_norm is a composite (more kept), gloo has no NCCL buffers
    and the host copies of the state share the device's memory."""
    m, lay, e, last = work.model, layout, act_bytes(work), stage.last
    local = stage.params / lay.tp  # TP splits the matrices; norms' gains are negligible
    # ZeRO-1 shards the optimizer state over dp_shard × cp, ZeRO-2 the gradients too, ZeRO-3 (FSDP) the parameters
    # too. The routed experts are split over ep ranks and sharded over the dp_shard × cp / ep left over: sharded,
    # they are 1 / (dp_shard × cp) of them too; what stays whole holds 1 / ep of them.
    sharded = {"optimizer": True, "grads": lay.zero >= 2, "params": lay.zero >= 3}
    experts = stage.experts / lay.tp
    whole = local - experts + experts / lay.ep
    state = {name: local * size / lay.shard() if sharded[name] else whole * size
             for name, size in state_bytes(work).items()}
    full, ckpt = block_activations(work, lay.micro_batch, lay.tp, lay.sp, composite_norm=cpu, cp=lay.cp)
    full_moe = block_activations(work, lay.micro_batch, lay.tp, lay.sp, cpu, lay.cp, moe=True)[0] \
        if stage.moe_blocks else full
    blocks = stage.blocks
    checkpointed = {"none": 0, "full": blocks, "selective": math.ceil(blocks / AC_EVERY)}.get(lay.ac)
    if checkpointed is None:
        raise KeelError(f"activation checkpointing {lay.ac!r}: expected none, selective or full")
    moe_whole = min(blocks - checkpointed, stage.moe_blocks)  # the blocks kept whole: expert ones first
    kept = checkpointed * ckpt + (blocks - checkpointed - moe_whole) * full + moe_whole * full_moe
    tokens = work.local_tokens(lay)
    if last:  # final norm input (fp32; and normalised on a CPU) and the output projection's gathered input
        kept += 4 * tokens * m.dim * (2 if cpu else 1) / (lay.tp if lay.tp > 1 and lay.sp else 1)
        kept += e * tokens * m.dim
    # The backward pass peaks either at the loss (its logits buffers, last rank) or in a block: gradients the
    # size of its activations, a recomputed block's activations once more, and under CP the gathered K and V
    # with their gradients. The two never overlap.
    working = max(full, full_moe) * (2 if lay.ac != "none" else 1) + cp_kv_buffer(work, lay)
    backward = max(working, loss_buffer(work, tokens, lay) if last else 0.0)
    inflight = (stage.inflight - 1) * kept
    # Host copies of the parameters and optimizer state (checkpoint staging, in-memory snapshots): on a CPU
    # they are in the same memory.
    host = (state["params"] + state["optimizer"]) * work.host_copies if cpu else 0.0
    return {**state, "activations": kept, "pipeline_inflight": inflight, "backward": backward,
            "buffers": _comm_buffers(work, lay, stage, cpu), "host": host}


def _comm_buffers(work: Workload, lay: Layout, stage: Stage, cpu: bool) -> float:
    """Bytes communication holds through the step: NCCL's buffers, gathered FSDP units, gradient buckets. A
    block is the largest one as FSDP gathers it (`_gathered`)."""
    vocab = work.model.vocab_size * work.model.dim
    per_block = max(_gathered(lay, p, x) for p, x in zip(work.block_params, work.block_experts, strict=True))
    e = act_bytes(work)
    grad_bytes = e + (4 if e < 4 else 0)  # gradients in the parameters' dtype, and in fp32 for the reduction
    # One communicator per group: tp, pp, the sharding group (dp_shard × cp), dp_replicate and cp's own; with
    # experts, the expert-parallel group and the one that shards each group's experts.
    groups = (lay.tp, lay.pp, lay.shard(), lay.dp_replicate, lay.cp) + (
        (lay.ep, lay.expert_shard()) if lay.ep > 1 else ())
    buffers: float = 0 if cpu else NCCL_BUFFERS * sum(d > 1 for d in groups)
    if lay.shard() > 1 and lay.zero < 3:
        # The parameters stay whole; the gradients (bucketed by the DDP-style reducer) are reduced into their
        # shard, ZeRO-2 as they are produced (one bucket in flight, taken as one block's), ZeRO-1 at the end.
        buffers += per_block * GRAD_BUCKET_BYTES / lay.tp
    elif lay.shard() > 1 and lay.pp > 1:
        # Pipelining defers FSDP's gradient sync to the last micro-batch: the stage's parameters stay gathered
        # from its first forward to the sync (keel.parallel.apply, as torchtitan) and its unsharded gradients
        # accumulate through the step.
        buffers += _gathered(lay, stage.params, stage.experts) / lay.tp * (e + grad_bytes)
    elif lay.shard() > 1:
        # Two blocks gathered (current and prefetched) plus the root unit (embedding, norm, output), which
        # FSDP does not reshard after the forward pass; one unit's unsharded gradients.
        root = work.n_params - sum(work.block_params)
        buffers += ((2 * per_block + root) * e + max(per_block, vocab) * grad_bytes) / lay.tp
    return buffers


def usable_bytes(hw: Accelerator) -> float:
    return hw.memory_bytes - RUNTIME_RESERVE


def memory(work: Workload, layout: Layout, hw: Accelerator) -> MemoryBreakdown:
    """Peak bytes per device of training `work` with `layout` on `hw`."""
    if min(layout.tp, layout.pp, layout.v, layout.dp_shard, layout.dp_replicate, layout.cp, layout.ep,
           layout.micro_batch) < 1:
        raise KeelError(f"layout {layout}: every degree and the micro-batch must be at least 1")
    ranks = [_rank(work, layout, stage, cpu=hw.key == "cpu") for stage in _stages(work, layout)]
    parts = max(ranks, key=lambda rank: sum(rank.values()))
    total = sum(parts.values())
    usable, reserved = usable_bytes(hw), total * (1 + hw.fragmentation)
    return MemoryBreakdown(**parts, total=total, reserved=reserved, capacity=hw.memory_bytes, usable=usable,
                           headroom=1 - reserved / usable if usable > 0 else -math.inf,
                           fits=reserved <= usable, layout=layout, device=hw.name)


def _moved(layout: Layout, dim: str, factor: int) -> Layout | None:
    """`layout` with `dim` multiplied by `factor`, the GPUs taken from data parallelism (shard first)."""
    for source in ("dp_shard", "dp_replicate"):
        if getattr(layout, source) % factor == 0:
            return replace(layout, **{dim: getattr(layout, dim) * factor,
                                      source: getattr(layout, source) // factor})
    return None


def cp_fits_sequence(work: Workload, tp: int, cp: int) -> bool:
    """Whether keel can split the sequence over cp ranks: into 2·cp equal chunks, each rank's share then split
    over tp by sequence parallelism."""
    if cp == 1:
        return work.seq_len % tp == 0
    return work.seq_len % (2 * cp) == 0 and (work.seq_len // cp) % tp == 0


def _fit_ep(layout: Layout) -> Layout:
    """`layout` with as many expert-parallel ranks as its dp_shard × cp still lends (ep must divide it)."""
    return replace(layout, ep=math.gcd(layout.ep, layout.shard())) if layout.ep > 1 else layout


def _candidates(work: Workload, layout: Layout, hw: Accelerator) -> list[Layout]:
    """The obvious fixes, in the order they cost least: for a mixture-of-experts model more expert
    parallelism (it borrows ranks: no GPUs move), more tensor parallelism within a node (not with experts),
    activation checkpointing, smaller micro-batches, more pipeline stages, more context parallelism (from
    CP_MIN_SEQ tokens on, as the search), all of them together, then more GPUs."""
    return [fixed for lay in _fixes(work, layout, hw) if (fixed := _fit_ep(lay)) != layout]


def _fixes(work: Workload, layout: Layout, hw: Accelerator) -> list[Layout]:
    m = work.model
    most_ep = math.gcd(layout.shard(), work.experts) if work.experts else 1  # the widest ep it can lend
    wider: list[Layout] = [replace(layout, ep=ep) for ep in range(layout.ep + 1, most_ep + 1) if most_ep % ep == 0]
    lay = layout
    while not work.experts and (moved := _moved(lay, "tp", 2)) and moved.tp <= hw.fabric() \
            and m.n_kv_heads % moved.tp == 0:
        wider.append(lay := moved)
    out = wider + [replace(layout, ac=ac) for ac in ("selective", "full") if layout.ac == "none" or ac == "full"]
    out += [replace(layout, micro_batch=mb) for mb in range(layout.micro_batch - 1, 0, -1)]
    lay = layout
    while (moved := _moved(lay, "pp", 2)) and moved.pp * moved.v <= m.n_layers:
        out.append(lay := moved)
    lay, long = layout, work.seq_len >= CP_MIN_SEQ
    while long and (moved := _moved(lay, "cp", 2)) and cp_fits_sequence(work, moved.tp, moved.cp):
        out.append(lay := moved)
    out.append(best := replace(wider[-1] if wider else layout, ac="full", micro_batch=1))
    while (moved := _moved(best, "pp", 2)) and moved.pp * moved.v <= m.n_layers:
        out.append(best := moved)
    for _ in range(12):  # up to 4096 times the GPUs
        out.append(best := replace(best, dp_shard=best.dp_shard * 2))
    return out


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
    """One line: why `layout` does not fit and the first obvious change that makes it fit: the fused cross
    entropy where it is enough, and the first change of layout."""
    mem = memory(work, layout, hw)
    if mem.fits:
        return mem.explain()
    where = " ".join(f"{name}={getattr(layout, name)}" for name in ("tp", "pp", "cp", "dp_shard", "dp_replicate", "ep")
                     if getattr(layout, name) > 1) or "one device"
    head = (f"needs {mem.reserved / GIB:.0f} GiB per device at {where}; {hw.name} has {hw.memory_bytes / GIB:.0f} "
            f"GiB ({mem.usable / GIB:.0f} usable)")
    tries = [_change(layout, fix)] if (fix := first_fix(work, layout, hw)) else []
    if work.cross_entropy != "fused" and memory(replace(work, cross_entropy="fused"), layout, hw).fits:
        tries.insert(0, "train.cross_entropy=fused")
    return f"{head}; try {' or '.join(tries)}" if tries else f"{head}; no layout change found that fits"


@dataclass(frozen=True)
class MemoryCheck:
    """The memory model's prediction for a run beside what the run measured: the largest of its ranks' peaks
    less what the rank held before building its model (`memory/above_runtime_bytes_max_rank`)."""
    predicted: MemoryBreakdown
    measured: float
    note: str = ""  # what the measurement holds that the model does not

    @property
    def error(self) -> float:
        """Predicted over measured, less 1."""
        return self.predicted.total / self.measured - 1


def check_run(run_dir: Path, hw: Accelerator | None = None) -> MemoryCheck:
    """Predict a keel run's peak memory from its config and layout and compare it with its measurement. The
    hardware is the run's own CPU, or `hw` for a GPU run."""
    trained = run_layout(run_dir)
    peaks = [r[METRIC] for r in read_jsonl(run_dir / "metrics.jsonl") if METRIC in r]
    if not peaks:
        raise KeelError(f"{run_dir}/metrics.jsonl has no {METRIC}: run it for at least monitor.interval steps")
    on_cpu = trained.device.startswith("cpu")
    if hw is None and not on_cpu:
        raise KeelError(f"{run_dir} ran on {trained.device}: name its accelerator (--hardware)")
    # The torch profiler's host buffers are in a CPU's resident set (on a GPU, not in CUDA's allocated memory).
    note = "profiled: the profiler's buffers are in the measured peak" if (
        on_cpu and trained.cfg.monitor.profile_interval > 0) else ""
    return MemoryCheck(memory(trained.work, trained.layout, by_key("cpu") if on_cpu or hw is None else hw), max(peaks),
                       note)


METRIC = "memory/above_runtime_bytes_max_rank"
