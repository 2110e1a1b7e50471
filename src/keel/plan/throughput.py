"""Step time of a layout: compute from FLOPs per token, communication from an alpha-beta model of each
collective, the pipeline bubble, and how much of the data-parallel traffic hides behind compute.

Compute: the step's kernels on the busiest pipeline rank (`keel.plan.kernels`: each GEMM at an efficiency set by
its shape, attention at its kernel's, the element-wise kernels, the loss and the optimizer at the memory
bandwidth), the recomputed forwards of activation checkpointing included (full: one more forward; selective in
keel: every second block, half a forward), over `Efficiency.compute`, the share of that time a step gets (launch
gaps, synchronisation and the kernels the model leaves out). MFU and HFU count FLOPs as their convention does
(6N + 12·L·H·Q·T, PaLM appendix B; `Workload.flops_per_token`), every query against every key.

Collectives, ring algorithm (Patarasuk & Yuan 2009; NCCL's ring): an all-gather or reduce-scatter of a
buffer of S bytes over n ranks moves (n−1)/n·S through each rank's link, an all-reduce 2(n−1)/n·S.
Time = latency + moved bytes / (link bandwidth × `Efficiency.link`); latency = NCCL's base latency of a
ring plus one hop latency per step, intra- or inter-node (NCCL src/graph/tuning.cc, Simple protocol:
base 8.4 µs, per hop 3.4 µs NVLink, 9.6 µs network).

Placement: ranks are numbered tp fastest, then cp, dp_shard, pp, dp_replicate, so a group's members are
`stride` ranks apart (stride = product of the degrees inside it). A group whose span fits in one scale-up
fabric (`Accelerator.fabric`: a node's NVLink, an NVL72 rack's, a TPU slice's inter-chip torus) uses
`hw.intra_bw`; otherwise each member talks through its own NIC at `hw.inter_bw` (one NIC per device, as on
DGX/HGX; a TPU slice's share of the data-centre network), which is what nccl-tests' bus bandwidth shows
across nodes, and each step of the ring that crosses fabrics costs the network's hop latency.

What each parallelism costs per step and device (keel's FSDP2 and pipelining behaviour):
- TP with sequence parallel: all-gather + reduce-scatter of the micro-batch's activations (the bytes of
  one all-reduce) twice per layer forward, twice backward, twice per recomputed forward (Korthikanti et
  al. 2022, arXiv 2205.05198, §4.2.2), on the critical path (no async TP).
- CP over cp ranks (stride tp: the scale-up fabric while tp·cp fits in one, the network otherwise): per block and
  micro-batch, an all-gather of its K and V at full sequence length (2·s·n_kv_heads·head_dim elements
  per sequence, the heads split by tp) in the forward, again in the backward and in each recomputed
  forward, and a reduce-scatter of their gradients (`cp_exchange`). On the critical path like TP's
  collectives: attention waits for its gathered K and V (no ring-attention pipelining), so none of it is
  hidden. Compute needs no CP term: each rank computes its share of the tokens, and the head-tail chunks
  give every rank the same share of the causal attention.
- FSDP over dp_shard × cp: all-gather of the bf16 parameters in the forward and again in the backward
  (reshard after forward), reduce-scatter of fp32 gradients (keel's reduce_dtype default), one call per
  block. Without a pipeline keel syncs every micro-batch; with one, the schedule gathers once and
  reduces once per step. Under expert parallelism a block's routed experts are 1/ep of them per rank,
  gathered and reduced over the dp_shard × cp / ep ranks that hold the same experts (stride tp·ep), one
  call per expert block.
- EP over ep consecutive ranks of dp_shard × cp (stride tp: the fabric while tp·ep fits in one, the network
  otherwise): per expert block and micro-batch, the rows of the top_k choices of each of the rank's tokens
  go to the ranks holding their experts and their outputs come back (two all_to_all_single, dispatch and
  combine, of top_k · tokens · dim activations, of which (ep−1)/ep leave the rank when the choices spread
  evenly), in the forward, again reversed in the backward, and once more in each recomputed forward
  (`ep_exchange`). Each exchange costs one base latency and one hop, its peers served at once, and its
  bytes at the link's bandwidth. On the critical path like TP's and CP's collectives: the experts wait
  for their rows and the block for their outputs (keel overlaps neither), so none of it is hidden. The
  counts' exchange before each dispatch (a few bytes per expert) is left out.
- ZeRO-1/2 over dp_shard (`Layout.zero`): parameters whole on every rank; gradients reduce-scattered into
  their shard (ZeRO-2 every micro-batch, ZeRO-1 once per step) and the updated parameters all-gathered once
  per step (Rajbhandari et al. 2020, arXiv 1910.02054, §5-7).
- HSDP/DP over dp_replicate: all-reduce of this shard's fp32 gradients across replicas.
- PP, by schedule (`Layout.pp_schedule`): GPipe and 1F1B idle (p−1)/(m+p−1) of the step, (p−1)/m of the
  ideal time; interleaved 1F1B with v chunks per rank (p−1)/(v·m) (Narayanan et al. 2021, arXiv
  2104.04473, §2.2); interleaved zero bubble a third of that: the backward split into its input and weight
  halves, the weights' fill the bubble but for the forward and input-backward's share, (T_F + T_B − T_W) /
  (T_F + T_B + T_W) = 1/3 of 1F1B's with the three equal (ZB-H1, Qi et al. 2024, arXiv 2401.10241, §3.1).
  Activations (sharded over tp with sequence parallel) are sent forward and gradients back for every
  micro-batch and chunk, on the critical path.
Only FSDP/DP traffic overlaps compute (prefetch, backward overlap): `Efficiency.overlap` of it is
hidden, never more than there is compute to hide it behind.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, replace
from pathlib import Path

from keel.config import head_size
from keel.core.accelerators import CATALOG, Accelerator, by_key
from keel.errors import KeelError
from keel.plan.kernels import Kernels, kernel_seconds, kernels_for, peak_flops
from keel.plan.layout import SOFTWARE, Layout, Workload, rank_blocks, rank_moe_blocks, run_layout
from keel.plan.memory import act_bytes
from keel.rundir.events import read_jsonl

BASE_LATENCY = 8.4e-6  # s, NCCL ring Simple base latency (src/graph/tuning.cc baseLat)
HOP_INTRA = 3.4e-6  # s per ring step over NVLink (tuning.cc hwLat NVLINK, ring, Simple)
HOP_INTER = 9.6e-6  # s per ring step over the network (tuning.cc hwLat NET, ring, Simple)
RECOMPUTE = {"none": 0.0, "selective": 0.5, "full": 1.0}  # forwards recomputed; keel's selective: 1 block in 2
# The share of its 1F1B bubble a schedule leaves idle (the module's docstring: zero bubble, ZB-H1's third).
BUBBLE_SHARE = {"gpipe": 1.0, "1f1b": 1.0, "interleaved_1f1b": 1.0, "interleaved_zb": 1 / 3}
GRAD_BYTES = 4  # gradients are reduced in fp32 (parallel.reduce_dtype default, torchtitan's too)
# Float8 matmuls (torchao, scaled per row) cast both operands first: a bf16 tensor read for its scales, read again
# and written as float8, 5 bytes an element, by kernels bound by memory bandwidth. Per token and linear layer the
# forward casts the input, the backward the output's gradient twice (scaled by rows and by columns) and the input
# again: about twice its inputs and outputs, and the input once more per recomputed forward; each weight twice
# per micro-batch (once more when recomputed).
CAST_BYTES = 5
# The share of the kernels' time a step gets, by accelerator generation: the median over the validation table's
# runs of that generation (bench/plan_validation.py, which also reports each run predicted with the factor fitted
# to the others), with each run's published kernels (`keel.plan.layout.SOFTWARE`).
GENERATIONS: dict[str, tuple[float, str]] = {  # by `Accelerator.generation`
    "hopper": (0.902, "Hopper: the median of 40 published runs on H100 and H800"),
    "ampere": (0.821, "Ampere: the median of 34 published runs on A100"),
    "blackwell": (0.760, "Blackwell: the median of 3 published runs on B200 and GB200"),
    "tpu-v4": (0.684, "TPU v4: PaLM 540B"),
}


@dataclass(frozen=True)
class Efficiency:
    """The factors that turn peak figures into time (tests/unit/plan/test_throughput.py checks them against
    every published run of the validation table):
    - compute: the share of the kernel model's time a step gets; by generation where published runs give it
      (GENERATIONS: 0.90 Hopper, 0.82 Ampere, 0.76 Blackwell, 0.68 TPU v4). Hardware without kernel figures
      (`keel.plan.kernels.KERNELS`) has every kernel at its peak, and 0.52 of that, the midpoint of every
      published run's whole-step efficiency; with its kernels measured instead (a cluster file's figures,
      `keel plan --calibrate-sweep`), the median of the generations' factors (`MEASURED_KERNELS`).
    - overlap 0.9: FSDP2 prefetch and backward reduce-scatter hide nearly all data-parallel traffic that
      fits under compute: torchtitan's Llama 3.1 8B lost 2.7% per GPU going from FSDP over NVLink (8
      GPUs) to FSDP over InfiniBand (128 GPUs), where its traffic is ~70% of the compute time.
    - link 0.8: collectives reach ~80-88% of the one-direction link figure (nvbandwidth 88% on H200,
      A100 all-reduce ~80%: ml-engineering network chapter).
    `calibrate` fits them to a measured run instead."""

    compute: float = 0.52
    overlap: float = 0.9
    link: float = 0.8
    source: str = "defaults"
    kernels: Kernels | None = None  # a cluster file's kernel figures; None: the generation's (KERNELS)

    def kernels_on(self, hw: Accelerator) -> Kernels:
        """The kernel figures the step is timed with on `hw`."""
        return self.kernels or kernels_for(hw)


DEFAULT = Efficiency()
# The share of the kernels' time a step gets on hardware whose kernels were measured but whose generation has no
# published runs: what the published generations' steps got of theirs (launch gaps, synchronisation, the kernels
# the model leaves out), their median.
MEASURED_KERNELS = statistics.median(compute for compute, _ in GENERATIONS.values())


def efficiency_for(hw: Accelerator, kernels_measured: bool = False) -> Efficiency:
    """The default factors with the compute efficiency of `hw`'s generation where published runs give one, or,
    without one, `MEASURED_KERNELS` where its kernels' figures were measured."""
    if hw.generation not in GENERATIONS:
        if kernels_measured:
            return replace(DEFAULT, compute=MEASURED_KERNELS, source="defaults; compute: the median of the published "
                           "generations' factors, with the kernels measured here")
        return DEFAULT
    compute, source = GENERATIONS[hw.generation]
    return replace(DEFAULT, compute=compute, source=f"defaults; compute from {source}")


@dataclass(frozen=True)
class StepBreakdown:
    """Seconds per optimizer step on one device. fsdp_comm and dp_comm are the whole traffic; only
    `exposed_comm` (TP, CP, EP, pipeline transfers and the unhidden FSDP/DP part) adds to the step."""

    compute: float
    tp_comm: float
    cp_comm: float
    ep_comm: float
    fsdp_comm: float
    dp_comm: float
    pp_p2p: float
    bubble: float
    exposed_comm: float
    total: float
    tokens_per_s_per_device: float
    mfu: float  # model FLOPs (6N + attention) against the dense peak
    hfu: float  # hardware FLOPs, recompute included

    def parts(self) -> dict[str, float]:
        """What the step time is made of; the values add up to `total`."""
        hidden_part = self.exposed_comm - self.tp_comm - self.cp_comm - self.ep_comm - self.pp_p2p
        return {"compute": self.compute, "tp_comm": self.tp_comm, "cp_comm": self.cp_comm, "ep_comm": self.ep_comm,
                "pp_p2p": self.pp_p2p, "bubble": self.bubble, "fsdp_dp_exposed": hidden_part}

    def explain(self) -> str:
        share = {name: value / self.total for name, value in self.parts().items() if value > 0}
        text = ", ".join(f"{name} {value:.0%}" for name, value in sorted(share.items(), key=lambda kv: -kv[1]))
        return (f"{self.total:.3g} s/step ({text}); {self.tokens_per_s_per_device:,.0f} tokens/s/device, "
                f"MFU {self.mfu:.1%}")


@dataclass(frozen=True)
class _Link:
    bandwidth: float  # bytes/s actually reached
    nodes: int  # scale-up fabrics the group spans (nodes; NVL72 racks or TPU slices where the fabric spans hosts)


def _link(hw: Accelerator, stride: int, size: int, eff: Efficiency) -> _Link:
    fabric = hw.fabric()
    if stride * size <= fabric:
        return _Link(hw.intra_bw * eff.link, 1)
    fabrics = size if stride >= fabric else math.ceil(stride * size / fabric)
    return _Link(hw.inter_bw * eff.link, fabrics)


def collective(kind: str, nbytes: float, n: int, link: _Link) -> float:
    """Seconds for one ring collective ("all_gather", "reduce_scatter", "all_reduce") of a buffer of
    `nbytes` (the full, unsharded size) over `n` ranks."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    if link.bandwidth <= 0:
        raise KeelError("the hardware has no link bandwidth for its collectives (intra_bw/inter_bw are 0): "
                        "measure it, or calibrate from a run")
    steps = 2 * (n - 1) if kind == "all_reduce" else n - 1
    inter = 0 if link.nodes <= 1 else min(steps, 2 * link.nodes if kind == "all_reduce" else link.nodes - 1)
    latency = BASE_LATENCY + (steps - inter) * HOP_INTRA + inter * HOP_INTER
    return latency + steps / n * nbytes / link.bandwidth


def _compute(work: Workload, layout: Layout, hw: Accelerator, eff: Efficiency, recompute: float) -> float:
    """One device's kernels of a step on the busiest pipeline rank (keel.plan.kernels), over the compute
    efficiency; with torchao's fp8, the casts of the blocks' linear layers at memory bandwidth."""
    kern = eff.kernels_on(hw)
    compute = kernel_seconds(work, layout, hw, kern, SOFTWARE[work.software], recompute) / eff.compute
    if work.fp8 and hw.memory_bw > 0:
        # A TP rank holds a slice of each weight, and of one side of each layer (the other side whole).
        tokens = work.global_batch * work.seq_len / layout.gpus()
        weights = work.block_matmul_params / (layout.pp * layout.tp) * work.micro_batches(layout) * (2 + recompute)
        activations = tokens * work.linear_widths / layout.pp * (1 + 1 / layout.tp) / 2 * (2 + recompute / 2)
        compute += CAST_BYTES * (weights + activations) / (hw.memory_bw * kern.memory)
    return compute


def _data_parallel_comm(work: Workload, layout: Layout, hw: Accelerator, eff: Efficiency, layers: int,
                        m_micro: int, act_dtype: int) -> tuple[float, float]:
    """(FSDP or ZeRO traffic over dp_shard × cp (stride tp) and, for routed experts split over ep ranks, over
    the dp_shard × cp / ep ranks that hold the same experts (stride tp·ep); DP traffic over dp_replicate
    (stride tp·cp·dp_shard·pp)) of one step, `layers` blocks on the busiest pipeline rank."""
    local_params = work.n_params / (layout.tp * layout.pp)
    experts = sum(work.block_experts) / (layout.tp * layout.pp)
    calls = layers + 1  # one unit per block and the root (embeddings, norm, output)
    fsdp_comm = _sharded_comm(layout, hw, eff, local_params - experts, calls, layout.tp, layout.shard(), m_micro,
                              act_dtype)
    if experts:
        fsdp_comm += _sharded_comm(layout, hw, eff, experts / layout.ep, max(1, rank_moe_blocks(work, layout)),
                                   layout.tp * layout.ep, layout.expert_shard(), m_micro, act_dtype)
    syncs = 1 if layout.pp > 1 else m_micro
    shard = layout.shard()
    dp_link = _link(hw, layout.tp * shard * layout.pp, layout.dp_replicate, eff)
    dp_comm = syncs * calls * collective("all_reduce", GRAD_BYTES * local_params / shard / calls,
                                         layout.dp_replicate, dp_link)
    return fsdp_comm, dp_comm


def _sharded_comm(layout: Layout, hw: Accelerator, eff: Efficiency, params: float, calls: int, stride: int,
                  shard: int, m_micro: int, act_dtype: int) -> float:
    """Seconds of FSDP or ZeRO traffic a step for `params` parameters a rank holds whole, sharded over `shard`
    ranks `stride` apart, in `calls` units."""
    if shard <= 1 or params <= 0:
        return 0.0
    syncs = 1 if layout.pp > 1 else m_micro
    link = _link(hw, stride, shard, eff)
    if layout.zero >= 3:
        gathers = 1 if layout.pp > 1 else 2 * m_micro
        gather = collective("all_gather", act_dtype * params / calls, shard, link)
        scatter = collective("reduce_scatter", GRAD_BYTES * params / calls, shard, link)
        return calls * (gathers * gather + syncs * scatter)
    # ZeRO-1/2: the whole parameters stay; the gradients are reduce-scattered into their shard (ZeRO-2: every
    # micro-batch outside a pipeline; ZeRO-1: once per step) and the updated parameters all-gathered once.
    reduces = syncs if layout.zero == 2 else 1
    return calls * (reduces * collective("reduce_scatter", GRAD_BYTES * params / calls, shard, link)
                    + collective("all_gather", act_dtype * params / calls, shard, link))


def cp_kv_bytes(work: Workload, layout: Layout) -> float:
    """Bytes of one block's K and V for a micro-batch at the full sequence length, the heads split by tp: what
    each CP all-gather fills and each reduce-scatter of their gradients empties."""
    m = work.model
    return 2 * work.seq_len * layout.micro_batch * m.n_kv_heads * head_size(m) / layout.tp * act_bytes(work)


def _cp_collectives(layout: Layout) -> tuple[float, int]:
    """(K/V all-gathers, gradient reduce-scatters) per block and micro-batch: forward, backward, recomputes."""
    return 2 + RECOMPUTE[layout.ac], 1


def cp_exchange(work: Workload, layout: Layout) -> float:
    """Bytes each rank receives per step in the CP exchange: a ring collective over cp ranks moves (cp−1)/cp of
    its buffer through each, for every collective of every block on the busiest pipeline rank and every
    micro-batch."""
    if layout.cp == 1:
        return 0.0
    gathers, scatters = _cp_collectives(layout)
    per_block = (gathers + scatters) * (layout.cp - 1) / layout.cp * cp_kv_bytes(work, layout)
    return max(rank_blocks(work, layout)) * work.micro_batches(layout) * per_block


def _cp_comm(work: Workload, layout: Layout, hw: Accelerator, eff: Efficiency) -> float:
    """Seconds of the CP exchange per step (`cp_exchange`'s collectives, each with its latency)."""
    if layout.cp == 1:
        return 0.0
    link, kv = _link(hw, layout.tp, layout.cp, eff), cp_kv_bytes(work, layout)
    gathers, scatters = _cp_collectives(layout)
    per_block = gathers * collective("all_gather", kv, layout.cp, link) \
        + scatters * collective("reduce_scatter", kv, layout.cp, link)
    return max(rank_blocks(work, layout)) * work.micro_batches(layout) * per_block


def ep_exchange_bytes(work: Workload, layout: Layout) -> float:
    """Bytes of one expert-parallel exchange on a rank: the rows of a micro-batch's top_k choices per token
    (its CP share), in the activations' dtype."""
    m = work.model
    return m.moe.top_k * work.local_tokens(layout) * m.dim * act_bytes(work)


def _ep_exchanges(work: Workload, layout: Layout) -> float:
    """Exchanges per step on the rank with the most expert blocks: dispatch and combine in the forward, their
    reverses in the backward, and the pair again in each recomputed forward, per expert block and
    micro-batch."""
    return (4 + 2 * RECOMPUTE[layout.ac]) * rank_moe_blocks(work, layout) * work.micro_batches(layout)


def ep_exchange(work: Workload, layout: Layout) -> float:
    """Bytes each rank sends per step in the expert-parallel all-to-all (and receives, when the choices spread
    evenly over the experts): (ep−1)/ep of every exchange leaves the rank."""
    if layout.ep == 1:
        return 0.0
    return _ep_exchanges(work, layout) * (layout.ep - 1) / layout.ep * ep_exchange_bytes(work, layout)


def ep_link(hw: Accelerator, layout: Layout, eff: Efficiency = DEFAULT) -> _Link:
    """The link an expert-parallel group runs on: its ep ranks are tp apart (within dp_shard × cp)."""
    return _link(hw, layout.tp, layout.ep, eff)


def all_to_all(nbytes: float, n: int, link: _Link) -> float:
    """Seconds for one all_to_all_single of `nbytes` a rank holds over `n` ranks: (n−1)/n of it leaves the rank,
    to every peer at once (one base latency and one hop)."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    if link.bandwidth <= 0:
        raise KeelError("the hardware has no link bandwidth for its collectives (intra_bw/inter_bw are 0): "
                        "measure it, or calibrate from a run")
    hop = HOP_INTER if link.nodes > 1 else HOP_INTRA
    return BASE_LATENCY + hop + (n - 1) / n * nbytes / link.bandwidth


def _ep_comm(work: Workload, layout: Layout, hw: Accelerator, eff: Efficiency) -> float:
    """Seconds of the expert-parallel all-to-all per step (`ep_exchange`'s exchanges, each with its latency)."""
    if layout.ep == 1:
        return 0.0
    one = all_to_all(ep_exchange_bytes(work, layout), layout.ep, ep_link(hw, layout, eff))
    return _ep_exchanges(work, layout) * one


def step_time(work: Workload, layout: Layout, hw: Accelerator, eff: Efficiency = DEFAULT) -> StepBreakdown:
    """Predicted time of one optimizer step of `work` laid out as `layout` on `hw`."""
    m = work.model
    gpus = layout.gpus()
    m_micro = work.micro_batches(layout)
    if layout.ac not in RECOMPUTE:
        raise KeelError(f"activation checkpointing {layout.ac!r}: expected none, selective or full")
    recompute = RECOMPUTE[layout.ac]
    peak = peak_flops(work, hw)
    tokens_per_device = work.global_batch * work.seq_len / gpus
    # The pipeline runs at its busiest rank's pace: its compute is the step's.
    compute = _compute(work, layout, hw, eff, recompute)

    act_dtype = act_bytes(work)
    layers = max(rank_blocks(work, layout))  # on the busiest pipeline rank, all its chunks
    act = work.local_tokens(layout) * m.dim * act_dtype  # one micro-batch's hidden states (its CP share)

    # TP: the bytes of one all-reduce (= reduce-scatter + all-gather with SP) per pair of collectives.
    tp_link = _link(hw, 1, layout.tp, eff)
    per_layer = 4 + 2 * recompute
    if layout.sp and layout.tp > 1:
        one = collective("all_gather", act, layout.tp, tp_link) + collective("reduce_scatter", act, layout.tp, tp_link)
    else:
        one = collective("all_reduce", act, layout.tp, tp_link)
    tp_comm = layers * m_micro * per_layer / 2 * one if layout.tp > 1 else 0.0

    fsdp_comm, dp_comm = _data_parallel_comm(work, layout, hw, eff, layers, m_micro, act_dtype)
    cp_comm = _cp_comm(work, layout, hw, eff)
    ep_comm = _ep_comm(work, layout, hw, eff)

    # PP: activations forward and gradients back across each stage boundary, per micro-batch and chunk.
    pp_p2p = bubble = 0.0
    if layout.pp > 1:
        pp_link = _link(hw, layout.tp * layout.shard(), layout.pp, eff)
        sent = act / (layout.tp if layout.sp else 1)
        pp_p2p = 2 * layout.v * m_micro * (BASE_LATENCY + sent / pp_link.bandwidth)
        bubble = (compute + tp_comm + cp_comm + ep_comm + pp_p2p) * (layout.pp - 1) / (layout.v * m_micro) \
            * BUBBLE_SHARE[layout.pp_schedule()]

    hideable = fsdp_comm + dp_comm
    exposed_dp = hideable - min(eff.overlap * hideable, compute)
    exposed = tp_comm + cp_comm + ep_comm + pp_p2p + exposed_dp
    total = compute + bubble + exposed
    tps = tokens_per_device / total
    mfu = tps * work.flops_per_token / peak
    return StepBreakdown(compute, tp_comm, cp_comm, ep_comm, fsdp_comm, dp_comm, pp_p2p, bubble, exposed, total,
                         tps, mfu, mfu * (1 + recompute / 3))


@dataclass(frozen=True)
class MeasuredRun:
    """What a keel run directory says about its own speed: averages over the logged windows after the
    first (which holds the warm-up), comm_s scaled from the profiled step's share to the window's mean."""

    work: Workload
    layout: Layout
    hw: Accelerator  # the catalog entry, with the peak the run measured MFU against
    step_s: float
    comm_s: float
    mfu: float
    tokens_per_s: float


def _records(path: Path, kind: str | None = None) -> list[dict]:
    return [r for r in read_jsonl(path) if kind is None or r.get("kind") == kind]


def _run_hardware(device: str, peak: float, busbw: float, hw: Accelerator | None) -> Accelerator:
    """The accelerator a run used: the one given, the CPU entry, or the catalog entry with the run's peak.
    Bandwidths the catalog lacks (a CPU's) come from the preflight all-reduce measurement."""
    if hw is None and device.startswith("cpu"):
        hw = by_key("cpu")
    if hw is None:
        hw = next((a for a in CATALOG if any(abs(p - peak) <= 0.02 * peak for p in a.peak_flops.values())), None)
    if hw is None:
        raise KeelError(f"the run's peak {peak / 1e12:.1f} TFLOP/s matches no catalog accelerator: name the hardware")
    hw = replace(hw, peak_flops={**hw.peak_flops, "bf16": peak, "fp32": peak})
    if busbw > 0 and hw.intra_bw <= 0:
        hw = replace(hw, intra_bw=busbw)
    if busbw > 0 and hw.inter_bw <= 0:
        hw = replace(hw, inter_bw=busbw)
    return hw


def measured_run(run_dir: Path, hw: Accelerator | None = None) -> MeasuredRun:
    """Workload, layout, hardware and measured step of a keel run directory (config.toml, metrics.jsonl,
    events.jsonl)."""
    run_dir = Path(run_dir)
    trained = run_layout(run_dir)
    windows = [r for r in _records(run_dir / "metrics.jsonl") if r.get("time/step_s") and r.get("throughput/mfu")]
    windows = windows[1:] if len(windows) > 1 else windows
    watched = [r for r in windows if r.get("time/comm_share") is not None]
    if not watched:
        raise KeelError(f"{run_dir}/metrics.jsonl has no profiled steps (time/comm_share): run with "
                        f"monitor.profile_interval at most monitor.interval")
    # The profiler's tracing slows the step it watches (several times over on a CPU): the step's time and speed
    # come from the logged windows without a profiled step where there are some.
    every, profiled = trained.cfg.monitor.interval, trained.cfg.monitor.profile_interval
    timed = [r for r in windows if not any(s % profiled == 0 for s in range(r["step"] - every + 1, r["step"] + 1))
             ] or windows
    step_s = statistics.fmean(r["time/step_s"] for r in timed)
    comm_share = statistics.fmean(r["time/comm_share"] for r in watched)
    mfu = statistics.fmean(r["throughput/mfu"] for r in timed)
    peak = statistics.fmean(r["throughput/tflops_per_device"] * 1e12 / r["throughput/mfu"] for r in windows)
    checks = [c for r in _records(run_dir / "events.jsonl", "preflight") for c in r["detail"].get("checks", [])]
    busbw = [c["values"]["busbw_gbs"] * 1e9 for c in checks if "busbw_gbs" in c.get("values", {})]
    hw = _run_hardware(trained.device, peak, statistics.fmean(busbw) if busbw else 0.0, hw)
    return MeasuredRun(trained.work, trained.layout, hw, step_s, comm_share * step_s, mfu,
                       statistics.fmean(r["throughput/tokens_per_s"] for r in timed))


def calibrate(run_dir: Path, hw: Accelerator | None = None) -> Efficiency:
    """Efficiency factors that reproduce a measured run. The profiler measures the wall time collectives
    were in flight (comm_s, pipeline waits included); the rest of the step is compute. So:
    compute = the kernel model's time for the step (recompute included) / (step − comm), the share of it the
    compute-bound part reached; the exposed data-parallel traffic is
    what comm_s leaves after the predicted bubble, TP and pipeline transfers, and overlap = 1 − exposed /
    predicted. When comm_s exceeds all
    the predicted traffic even with nothing hidden, the link is slower than assumed: overlap = 0 and
    the link factor shrinks until the prediction matches."""
    run = measured_run(run_dir, hw)
    nominal = step_time(run.work, run.layout, run.hw, Efficiency(compute=1.0, overlap=0.0, link=DEFAULT.link))
    layout = run.layout
    bubble_share = (layout.pp - 1) / (layout.v * run.work.micro_batches(layout)) if layout.pp > 1 else 0.0
    fixed = nominal.tp_comm + nominal.cp_comm + nominal.ep_comm + nominal.pp_p2p  # never hidden
    compute_s = run.step_s - run.comm_s
    if compute_s <= 0:
        raise KeelError(f"{run_dir}: the measured communication ({run.comm_s:.3g} s) fills the whole step "
                        f"({run.step_s:.3g} s); nothing to calibrate compute on")
    compute = nominal.compute / compute_s
    exposed = run.comm_s - bubble_share * (compute_s + fixed)
    hideable = nominal.fsdp_comm + nominal.dp_comm
    link, overlap = DEFAULT.link, 0.0
    if exposed > fixed + hideable or hideable <= 0:
        link = DEFAULT.link * (fixed + hideable) / max(exposed, 1e-12)
    else:
        overlap = min(1.0, max(0.0, 1 - (exposed - fixed) / hideable))
    return Efficiency(compute=compute, overlap=overlap, link=link, source=f"calibrated on {Path(run_dir).name}")
