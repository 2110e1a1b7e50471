"""What the planner plans: a parallel layout, and the workload it runs (model, sequence, batch, tokens)."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from functools import cache, cached_property
from pathlib import Path

from keel.config import Config, ModelConfig, load_config
from keel.errors import KeelError
from keel.model.flops import (
    active_param_count,
    attention_flops_per_token,
    block_param_count,
    flops_per_token,
    linear_widths_per_token,
    matmul_param_count,
    param_count,
    routed_expert_param_count,
)
from keel.model.split import stage_blocks
from keel.parallel.degrees import given, resolve_degrees
from keel.rundir.events import read_jsonl

ACS = ("none", "selective", "full")
# Context parallelism is planned from this sequence length on (searched, suggested), and below it only when
# nothing fits without it. It buys memory (activations / cp) with traffic, and it costs what the step model does
# not see: shorter per-rank sequences run attention and the matmuls less efficiently, and the head-tail masks add
# kernel work. Where memory does not need it the search would prefer it to TP on the exchange volume alone.
# Published runs use it for long sequences only: Llama 3 pre-trained at 8,192 with cp = 1 and turned it on for
# the long-context stage (arXiv 2407.21783 §3.3.2, Table 4). From 16,384, twice that, a sequence's activations
# outgrow a device (8B: 2.8 GiB a block kept, 90 GiB for 32 blocks at tp = 1) and attention is over a third of
# the FLOPs; the search stays as small as before for the usual 2-8k sequences.
CP_MIN_SEQ = 16_384


# The pipeline schedules keel runs (parallel.pp_schedule): the first two with one stage per rank (v = 1), the
# interleaved ones with several.
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "interleaved_zb")


@dataclass(frozen=True)
class Layout:
    tp: int = 1  # tensor parallel (with sequence parallel when sp)
    pp: int = 1  # pipeline stages across ranks
    v: int = 1  # stages (model chunks) per pipeline rank: an interleaved schedule when > 1
    dp_shard: int = 1  # FSDP sharding degree
    dp_replicate: int = 1  # HSDP replicas
    # context parallel: each sequence split into 2·cp chunks over cp ranks (rank r holds chunks r and 2·cp−1−r);
    # data-parallel for the parameters (FSDP shards over dp_shard × cp), not for the batch
    cp: int = 1
    # expert parallel: a mixture-of-experts model's routed experts split over ep consecutive ranks of dp_shard × cp
    # (borrowed from them: not a factor of the device count), each group's experts FSDP-sharded over the
    # dp_shard × cp / ep ranks left over
    ep: int = 1
    micro_batch: int = 1  # sequences per micro-batch per rank
    ac: str = "none"  # activation checkpointing: none | selective | full
    sp: bool = True  # sequence parallel alongside tp > 1
    # What dp_shard shards (ZeRO, arXiv 1910.02054): 3 = FSDP, parameters, gradients and optimizer state (what
    # keel runs); 2 = gradients and optimizer state; 1 = optimizer state only.
    zero: int = 3
    # The pipeline schedule (SCHEDULES); "": 1F1B, interleaved when v > 1, the one the search plans with.
    schedule: str = ""

    def pp_schedule(self) -> str:
        """The pipeline schedule this layout runs (parallel.pp_schedule)."""
        return self.schedule or ("interleaved_1f1b" if self.v > 1 else "1f1b")

    def gpus(self) -> int:
        return self.tp * self.pp * self.dp_shard * self.dp_replicate * self.cp

    def dp(self) -> int:
        """Data-parallel ranks that split the batch: the CP ranks of a group share their sequences."""
        return self.dp_shard * self.dp_replicate

    def shard(self) -> int:
        """Ranks the sharded state (FSDP, ZeRO) is split over: dp_shard × cp, as torchtitan does."""
        return self.dp_shard * self.cp

    def expert_shard(self) -> int:
        """Ranks that hold the same experts and shard them (efsdp): dp_shard × cp / ep."""
        return self.shard() // self.ep

    def spec(self) -> str:
        """The layout as `keel plan --layout` takes it."""
        return ",".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self)
                        if f.name != "sp" and (f.name != "schedule" or self.schedule))

    def describe(self) -> str:
        parts = [f"{name}{value}" for name, value in (("tp", self.tp), ("pp", self.pp), ("cp", self.cp),
                                                       ("dp_shard", self.dp_shard),
                                                       ("dp_replicate", self.dp_replicate), ("ep", self.ep))
                 if value > 1]
        if self.v > 1:
            parts.append(f"v{self.v}")
        parts.append(f"mb{self.micro_batch}")
        if self.ac != "none":
            parts.append(f"ac={self.ac}")
        if self.zero != 3 and self.dp_shard > 1:
            parts.append(f"zero={self.zero}")
        if self.pp > 1 and self.pp_schedule() not in ("1f1b", "interleaved_1f1b"):
            parts.append(self.pp_schedule())
        return " ".join(parts)


@dataclass(frozen=True)
class Software:
    """What the trainer runs: its attention kernel ("fused": the best flash kernel of the hardware, FlashAttention-3
    or cuDNN's on Hopper, FlashAttention-2 on Ampere; "flash2": FlashAttention-2, PyTorch's SDPA; "materialised":
    the scores written out by a batched GEMM, every one of them computed, the causal half too) and whether its
    element-wise kernels are fused. `regathers` is Megatron-Core's sequence parallelism: a norm output's shard is
    kept for the backward pass and all-gathered again there (Korthikanti et al. 2022 §4.2.2), where keel's DTensor
    one keeps the gathered tensor. A materialised attention keeps `scores_kept` bytes a score (16-bit) for its
    backward pass, or recomputes the scores there (`recomputes_scores`: Megatron-LM's selective recomputation)."""

    attention: str
    fused: bool
    source: str
    regathers: bool = False
    scores_kept: int = 0
    recomputes_scores: bool = False


SOFTWARE: dict[str, Software] = {
    "eager": Software("flash2", False, "PyTorch eager with SDPA (keel, torchtitan without torch.compile)"),
    "compiled": Software("flash2", True, "torch.compile: the element-wise kernels fused; attention through SDPA"),
    "transformer-engine": Software("fused", True, "Megatron-Core and NeMo with Transformer Engine", regathers=True),
    # The softmax's output, which the product with V takes too, is kept: 2 bytes a score in 16-bit. A dropout after
    # the softmax would keep its mask and output as well (3 bytes more, Korthikanti et al. 2022 §4.1's 5as²b):
    # not counted, as not every run of these trainers used one.
    "unfused-attention": Software("materialised", True, "Megatron-LM before flash attention (2021-22): fused "
                                  "element-wise kernels and softmax, the scores materialised", regathers=True,
                                  scores_kept=2),
    "selective-recompute": Software("materialised", True, "Megatron-LM with selective recomputation (Korthikanti et "
                                    "al. 2022 §5): the scores materialised, recomputed in the backward pass rather "
                                    "than kept", regathers=True, recomputes_scores=True),
}


@dataclass(frozen=True)
class Workload:
    model: ModelConfig
    seq_len: int
    global_batch: int  # sequences per optimizer step
    tokens: float = 0.0  # the run's token budget
    param_dtype: str = "bf16"
    cross_entropy: str = "torch"  # train.cross_entropy: how much the loss keeps (keel.plan.memory.loss_buffer)
    z_loss: bool = False  # train.z_loss > 0: torch's loss keeps the exponentials of the logits too
    # Host copies of the parameters and optimizer state a rank keeps: the checkpoint's staging buffers and
    # the guards' in-memory snapshots (guard.snapshots). They share the device's memory on a CPU only.
    host_copies: int = 1
    fp8: bool = False  # train.precision = fp8: the blocks' linear layers multiply in float8
    software: str = "eager"  # the trainer's kernels (SOFTWARE): eager, or compiled blocks

    @classmethod
    def of(cls, cfg: Config, tokens: float = 0.0, param_dtype: str = "bf16") -> Workload:
        """The workload a config trains."""
        g = cfg.guard
        snapshots = g.snapshots if g.enabled and g.snapshot_interval else 0
        if snapshots and cfg.fault_tolerance.replica_groups > 1 and g.sdc.fingerprint_interval:
            snapshots += 1  # the last state the groups' fingerprints verified is kept besides the ring
        return cls(cfg.model, cfg.train.seq_len, cfg.train.global_batch, tokens, param_dtype,
                   cfg.train.cross_entropy, cfg.train.z_loss > 0, 1 + snapshots, cfg.train.precision == "fp8",
                   "compiled" if cfg.parallel.compile else "eager")

    @cached_property
    def n_params(self) -> int:
        """Every parameter, every expert's: what memory and checkpoints hold."""
        return param_count(self.model)

    @cached_property
    def n_active(self) -> int:
        """The parameters a token goes through (`n_params` for a dense model): what the FLOPs count."""
        return active_param_count(self.model)

    @cached_property
    def block_params(self) -> tuple[int, ...]:
        """Each block's parameters, every expert's."""
        return tuple(block_param_count(self.model, i) for i in range(self.model.n_layers))

    @cached_property
    def block_experts(self) -> tuple[int, ...]:
        """Each block's routed experts' parameters (0 in a dense block): what expert parallelism splits."""
        return tuple(routed_expert_param_count(self.model, i) for i in range(self.model.n_layers))

    @property
    def experts(self) -> int:
        """Routed experts per mixture-of-experts block (0: a dense model)."""
        return self.model.moe.experts

    @cached_property
    def flops_per_token(self) -> float:
        return flops_per_token(self.model, self.seq_len)

    def local_tokens(self, layout: Layout) -> float:
        """Tokens of one micro-batch on a rank: its sequences' share over the CP group."""
        return self.seq_len * layout.micro_batch / layout.cp

    def micro_batches(self, layout: Layout) -> int:
        """Micro-batches per step on each pipeline (each data-parallel rank)."""
        return max(1, self.global_batch // (layout.dp() * layout.micro_batch))

    def steps(self) -> int:
        return max(1, round(self.tokens / (self.global_batch * self.seq_len)))

    @cached_property
    def head_flops_per_token(self) -> float:
        """Training FLOPs per token of the output projection (forward 2·V·d, backward 4·V·d)."""
        return 6.0 * self.model.vocab_size * self.model.dim

    @cached_property
    def float8_flops_per_token(self) -> float:
        """Training FLOPs per token that run in float8: the blocks' linear layers with fp8 (the output projection
        and the attention scores stay in bf16, as torchao's conversion of the blocks leaves them); else 0."""
        if not self.fp8:
            return 0.0
        return self.flops_per_token - self.head_flops_per_token - attention_flops_per_token(self.model, self.seq_len)

    @cached_property
    def linear_widths(self) -> int:
        """The inputs and outputs a token has at the blocks' linear layers (what a float8 matmul casts)."""
        return linear_widths_per_token(self.model)

    @cached_property
    def block_matmul_params(self) -> int:
        """The blocks' parameters a token multiplies with (what a float8 matmul casts of the weights)."""
        return matmul_param_count(self.model) - self.model.vocab_size * self.model.dim



def rank_blocks(work: Workload, layout: Layout) -> list[int]:
    """Blocks on each pipeline rank: stage s of the pp × v stages (keel.model.split) is on rank s mod pp."""
    return [len(ids) for ids in rank_block_ids(work.model.n_layers, layout.pp, layout.v)]


@cache
def rank_block_ids(n_layers: int, pp: int, v: int) -> tuple[tuple[int, ...], ...]:
    """The blocks (by index) of each of the pp pipeline ranks, whose stage s of pp × v is on rank s mod pp."""
    ranks: list[list[int]] = [[] for _ in range(pp)]
    first = 0
    for stage, count in enumerate(stage_blocks(n_layers, pp * v)):
        ranks[stage % pp].extend(range(first, first + count))
        first += count
    return tuple(tuple(ids) for ids in ranks)


def rank_moe_blocks(work: Workload, layout: Layout) -> int:
    """Mixture-of-experts blocks on the pipeline rank with the most of them."""
    ids = rank_block_ids(work.model.n_layers, layout.pp, layout.v)
    return max(sum(work.block_experts[i] > 0 for i in rank) for rank in ids)


def _filled(values: dict[str, int | str | bool], gpus: int, where: str) -> Layout:
    """A layout whose dp_shard may be -1 (what the others leave of `gpus`), checked against `gpus`."""
    cp = int(values.get("cp", 1))
    with_cp = " × cp" if cp > 1 else ""  # named only where it is used: most layouts have none
    rest = int(values.get("tp", 1)) * int(values.get("pp", 1)) * int(values.get("dp_replicate", 1)) * cp
    if values.get("dp_shard", -1) == -1:
        if gpus % rest:
            raise KeelError(f"{where}: tp × pp × dp_replicate{with_cp} = {rest} does not divide --gpus {gpus}")
        values["dp_shard"] = gpus // rest
    layout = Layout(**values)  # type: ignore[arg-type]
    interleaved = layout.pp_schedule().startswith("interleaved")
    if interleaved != (layout.v > 1):  # as keel.parallel.degrees requires of parallel.pp_schedule
        raise KeelError(f"{where}: the {layout.pp_schedule()} schedule runs "
                        f"{'several stages' if interleaved else 'one stage'} per rank, not v = {layout.v}; "
                        f"{'raise v' if interleaved else 'use interleaved_1f1b or interleaved_zb'}")
    if layout.gpus() != gpus:
        raise KeelError(f"{where} uses {layout.gpus()} devices (tp × pp × dp_shard × dp_replicate{with_cp}), not "
                        f"--gpus {gpus}")
    return layout


# The keys `--layout` takes (docs/planning.md): every degree keel runs, and `zero` for another trainer's sharding.
# Sequence parallelism is not one: keel always runs it with TP.
LAYOUT_KEYS = ("tp", "pp", "v", "dp_shard", "dp_replicate", "cp", "ep", "micro_batch", "ac", "zero", "schedule")


def parse_layout(text: str, gpus: int) -> Layout:
    """`--layout tp=8,pp=16,cp=2,dp_shard=8,ep=8,micro_batch=1,ac=full,schedule=1f1b` (dp_shard left out: what
    the rest leaves)."""
    values: dict[str, int | str | bool] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or key not in LAYOUT_KEYS:
            raise KeelError(f"--layout {text!r}: {item!r} is not KEY=VALUE of {', '.join(LAYOUT_KEYS)}")
        if key == "ac":
            if raw not in ACS:
                raise KeelError(f"--layout {text!r}: ac={raw}: expected one of {', '.join(ACS)}")
            values[key] = raw
        elif key == "schedule":
            if raw not in SCHEDULES:
                raise KeelError(f"--layout {text!r}: schedule={raw}: expected one of {', '.join(SCHEDULES)}")
            values[key] = raw
        elif not raw.lstrip("-").isdigit() or (int(raw) < 1 and not (key == "dp_shard" and int(raw) == -1)):
            raise KeelError(f"--layout {text!r}: {key}={raw}: expected a positive whole number")
        elif key == "zero" and int(raw) not in (1, 2, 3):
            raise KeelError(f"--layout {text!r}: zero={raw}: expected 1 (optimizer state sharded), 2 (and "
                            f"gradients) or 3 (and parameters: FSDP)")
        else:
            values[key] = int(raw)
    return _filled(values, gpus, f"--layout {text!r}")


# Settings of [parallel] the planner's models do not represent: named in its answer, never silently dropped.
UNMODELLED = ("compile", "compile_mode", "reduce_dtype", "ac_every", "ac_selective")


def config_layout(cfg: Config, gpus: int) -> tuple[Layout | None, list[str]]:
    """The layout a config's [parallel] gives (None when it sets nothing: the planner searches), and the
    settings the planner does not model, as `key=value`."""
    p = cfg.parallel
    default = type(p)()  # with the registered degrees' options
    if p == default:
        return None, []
    values: dict[str, int | str | bool] = {"tp": p.tp, "pp": p.pp, "v": p.pp_stages_per_rank, "dp_shard": p.dp_shard,
                                           "dp_replicate": p.dp_replicate, "cp": given(p, "cp"),
                                           "ep": given(p, "ep"),
                                           "micro_batch": cfg.train.micro_batch, "ac": p.activation_checkpoint,
                                           "schedule": _schedule(p.pp, p.pp_schedule, p.pp_stages_per_rank)}
    layout = _filled(values, gpus, "the config's [parallel]")
    if p.pp > 1 and p.pp_microbatches:  # per data-parallel rank: the shard's share of the batch
        layout = replace(layout, micro_batch=max(1, cfg.train.global_batch // layout.dp() // p.pp_microbatches))
    unmodelled = [f"parallel.{k}={getattr(p, k)}" for k in UNMODELLED if getattr(p, k) != getattr(default, k)]
    return layout, unmodelled


def _schedule(pp: int, schedule: str, v: int) -> str:
    """A config's pipeline schedule as a layout's: "" where it is the one the planner takes by default."""
    return "" if pp == 1 or schedule == Layout(v=v).pp_schedule() else schedule


@dataclass(frozen=True)
class TrainedRun:
    """What a keel run directory trained: its config, workload and layout, and its start event's details."""
    cfg: Config
    work: Workload
    layout: Layout
    start: dict

    @property
    def device(self) -> str:
        return str(self.start["device"])


def run_layout(run_dir: Path) -> TrainedRun:
    """The workload and layout of a keel run directory (config.toml, events.jsonl's start event)."""
    if not (run_dir / "config.toml").exists():
        raise KeelError(f"{run_dir}: no config.toml, not a keel run directory")
    cfg = load_config(run_dir / "config.toml", [])
    starts = [r for r in read_jsonl(run_dir / "events.jsonl") if r.get("kind") == "start"]
    if not starts:
        raise KeelError(f"{run_dir}/events.jsonl has no start event: the run never trained")
    start = starts[-1]["detail"]
    p, kept = cfg.parallel, resolve_degrees(cfg, int(start["world_size"]))
    per_rank = cfg.train.global_batch // kept.dp
    micro = per_rank // kept.pp_microbatches if kept.pp > 1 else cfg.train.micro_batch
    layout = Layout(tp=kept.tp, pp=kept.pp, v=p.pp_stages_per_rank, dp_shard=kept.dp_shard,
                    dp_replicate=kept.dp_replicate, cp=kept.cp, ep=kept.ep, micro_batch=micro,
                    ac=p.activation_checkpoint, schedule=_schedule(kept.pp, p.pp_schedule, p.pp_stages_per_rank))
    precision = cfg.train.compute_precision(str(start["device"]).split(":")[0])  # "cuda:0" → cuda
    return TrainedRun(cfg, Workload.of(cfg, param_dtype=precision), layout, start)
