"""The degrees of a run's layout, resolved for its world size and checked against the model and the batch before
any process group exists (the launcher checks them too). Plain arithmetic: no torch, so that a command answers bad
input at once. `keel.parallel.layout.Layout` builds the device mesh from them and answers everything derived."""

from __future__ import annotations

import math
from dataclasses import dataclass

from keel.config import Config, FaultToleranceConfig
from keel.errors import ConfigError

# The mesh's dimensions, outermost first: tensor parallel innermost (the fastest links), then context parallel.
DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class Degrees:
    """dp_replicate × dp_shard × cp × tp × pp = world size."""

    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int = 1
    pp_microbatches: int = 0  # pipeline micro-batches per step and data-parallel rank
    cp: int = 1
    ep: int = 1  # experts split over ep ranks of dp_shard × cp: not a dimension of its own in the product

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many ways the global batch is split (the ranks of a context- or
        tensor-parallel group share their sequences)."""
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    def of(self, dim: str) -> int:
        return int(getattr(self, dim))

    def describe(self) -> str:
        parts = [f"{dim}{self.of(dim)}" for dim in DIMS if self.of(dim) > 1]
        layout = " × ".join(parts) if parts else "single process"
        return layout + (f", experts over ep{self.ep}" if self.ep > 1 else "")


def _product(cfg: Config, dp_shard: int | str) -> tuple[str, str]:
    """'pp × dp_replicate × dp_shard × tp' and its numbers, context parallelism named only when used."""
    p = cfg.parallel
    values = {"pp": p.pp, "dp_replicate": p.dp_replicate, "dp_shard": dp_shard, "cp": p.cp, "tp": p.tp}
    dims = [dim for dim in DIMS if dim != "cp" or p.cp > 1]
    return " × ".join(dims), " × ".join(str(values[dim]) for dim in dims)


def resolve_degrees(cfg: Config, world_size: int) -> Degrees:
    """Check the layout against the world size and the model before any process group exists."""
    p, t = cfg.parallel, cfg.train
    if p.dp_shard == 0:
        raise ConfigError("parallel.dp_shard = 0: expected a positive degree or -1 (the processes left over)")
    fixed = p.pp * p.dp_replicate * p.cp * p.tp * (p.dp_shard if p.dp_shard > 0 else 1)
    if world_size % fixed:
        dims, values = _product(cfg, p.dp_shard if p.dp_shard > 0 else "-1")
        raise ConfigError(f"parallel degrees {dims} = {values} do not divide the {world_size} processes")
    dp_shard = p.dp_shard if p.dp_shard > 0 else world_size // fixed
    dp = p.dp_replicate * dp_shard
    per_rank = t.global_batch // dp if t.global_batch % dp == 0 else 0
    microbatches = p.pp_microbatches or (per_rank // t.micro_batch if p.pp > 1 else 0)
    degrees = Degrees(p.dp_replicate, dp_shard, p.tp, p.pp, microbatches, p.cp, p.ep)
    if degrees.world_size != world_size:
        dims, values = _product(cfg, dp_shard)
        others = degrees.world_size // dp_shard
        fill = f"; parallel.dp_shard = {world_size // others} would fill them" if world_size % others == 0 else ""
        borrowed = " (parallel.ep is no factor: its ranks are borrowed from dp_shard × cp)" if p.ep > 1 else ""
        raise ConfigError(f"parallel degrees {dims} = {values} = {degrees.world_size}, but there are {world_size} "
                          f"processes; the product must equal them{fill}{borrowed}")
    if t.param_dtype == "bf16" and world_size > 1:
        raise ConfigError(f"train.param_dtype = 'bf16' is for one process; with {world_size} processes FSDP's mixed "
                          f"precision already computes on bf16 weights gathered from fp32 shards: set "
                          f"train.param_dtype = 'fp32'")
    if (dp_shard * p.cp) % p.ep:
        lender = f"dp_shard × cp = {dp_shard} × {p.cp}" if p.cp > 1 else f"dp_shard = {dp_shard}"
        raise ConfigError(f"parallel.ep = {p.ep} must divide {lender}: the expert-parallel ranks are borrowed "
                          f"from the ranks that shard the parameters")
    if p.pp > 1:
        _check_pipeline(cfg, degrees, per_rank)
    _check_shards(cfg)
    per_step = t.micro_batch * degrees.dp
    if t.global_batch % per_step:
        raise ConfigError(
            f"train.global_batch = {t.global_batch} must divide by train.micro_batch × data-parallel degree = "
            f"{t.micro_batch} × {degrees.dp}; choose a global batch that is a multiple of {per_step}")
    if cfg.eval.sequences % degrees.dp:
        raise ConfigError(f"eval.sequences = {cfg.eval.sequences} must divide by the data-parallel degree = "
                          f"{degrees.dp}")
    check_group_shares(cfg, degrees)
    return degrees


def _check_shards(cfg: Config) -> None:
    """Heads split over tensor parallel; each sequence into 2 × cp chunks, each rank's share over tensor parallel's
    sequence parallelism."""
    p, m, t = cfg.parallel, cfg.model, cfg.train
    for name, value in (("model.n_heads", m.n_heads), ("model.n_kv_heads", m.n_kv_heads)):
        if value % p.tp:
            raise ConfigError(f"{name} = {value} must divide by parallel.tp = {p.tp}")
    if t.seq_len % (2 * p.cp):
        raise ConfigError(f"train.seq_len = {t.seq_len} must divide by 2 × parallel.cp = {2 * p.cp} (each sequence "
                          f"is cut into 2 × cp chunks, two per context-parallel rank)")
    if (t.seq_len // p.cp) % p.tp:
        share = f"train.seq_len = {t.seq_len}" if p.cp == 1 else f"train.seq_len / parallel.cp = {t.seq_len // p.cp}"
        raise ConfigError(f"{share} must divide by parallel.tp = {p.tp}")


def check_group_shares(cfg: Config, degrees: Degrees) -> None:
    """Every number of live replica groups a step can have must split the global batch into whole
    micro-batches per rank: the survivors of a failure take the missing groups' share."""
    ft, t = cfg.fault_tolerance, cfg.train
    # A pipeline micro-batch keeps its size (the stages' buffers have it); a step runs more or fewer of them.
    chunk = t.global_batch // degrees.dp // degrees.pp_microbatches if degrees.pp > 1 else t.micro_batch
    for live in range(ft.min_replicas, ft.replica_groups + 1):
        per_rank = t.global_batch // (degrees.dp * live) if t.global_batch % (degrees.dp * live) == 0 else 0
        if not per_rank or per_rank % t.micro_batch or per_rank % chunk:
            raise ConfigError(f"train.global_batch = {t.global_batch} does not split into micro-batches of "
                              f"{max(t.micro_batch, chunk)} over {live} live replica group(s) of {degrees.dp} "
                              f"data-parallel rank(s); use a multiple of "
                              f"{max(t.micro_batch, chunk) * degrees.dp * _lcm_upto(ft)} or raise "
                              f"fault_tolerance.min_replicas")
        if degrees.pp > 1 and per_rank // chunk < degrees.pp:
            raise ConfigError(f"with {live} live replica group(s) each pipeline rank runs {per_rank // chunk} "
                              f"micro-batch(es) of {chunk}, fewer than parallel.pp = {degrees.pp}; raise "
                              f"train.global_batch or parallel.pp_microbatches")


def _lcm_upto(ft: FaultToleranceConfig) -> int:
    return math.lcm(*range(ft.min_replicas, ft.replica_groups + 1))


def _check_pipeline(cfg: Config, degrees: Degrees, per_rank: int) -> None:
    p, m = cfg.parallel, cfg.model
    stages = p.pp * p.pp_stages_per_rank
    if m.n_layers < stages:
        raise ConfigError(f"model.n_layers = {m.n_layers} cannot fill pp × pp_stages_per_rank = {p.pp} × "
                          f"{p.pp_stages_per_rank} stages of at least one block each")
    interleaved = p.pp_schedule.startswith("interleaved")
    if interleaved and p.pp_stages_per_rank < 2:
        raise ConfigError(f"parallel.pp_schedule = {p.pp_schedule!r} needs parallel.pp_stages_per_rank >= 2, "
                          f"not {p.pp_stages_per_rank}")
    if not interleaved and p.pp_stages_per_rank != 1:
        raise ConfigError(f"parallel.pp_schedule = {p.pp_schedule!r} runs one stage per rank, but "
                          f"parallel.pp_stages_per_rank = {p.pp_stages_per_rank}; use interleaved_1f1b or 1")
    if m.tie_embeddings:
        raise ConfigError("model.tie_embeddings = true cannot be pipelined: the embedding and the output "
                          "projection live in different stages; set parallel.pp = 1 or untie them")
    if per_rank == 0 or degrees.pp_microbatches == 0 or per_rank % degrees.pp_microbatches:
        raise ConfigError(f"the global batch per data-parallel rank ({cfg.train.global_batch} / {degrees.dp}) must "
                          f"split into parallel.pp_microbatches = {degrees.pp_microbatches} equal micro-batches")
    if degrees.pp_microbatches < p.pp:
        raise ConfigError(f"parallel.pp_microbatches = {degrees.pp_microbatches} must be at least parallel.pp = "
                          f"{p.pp} to fill the pipeline")
    val_per_rank = cfg.eval.sequences // degrees.dp
    if val_per_rank % degrees.pp_microbatches:
        raise ConfigError(f"eval.sequences per data-parallel rank ({val_per_rank}) must divide into "
                          f"parallel.pp_microbatches = {degrees.pp_microbatches} micro-batches")
