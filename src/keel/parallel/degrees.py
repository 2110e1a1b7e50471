"""The degrees of a run's layout, resolved for its world size and checked against the model and the batch before
any process group exists (the launcher checks them too). Plain arithmetic: no torch, so that a command answers bad
input at once. `keel.parallel.layout.Layout` builds the device mesh from them and answers everything derived.

pp, dp_replicate, dp_shard and tp are keel's own (`BUILTIN`); every other degree is declared by its own module of
keel.parallel.dims with `degree(...)`: its option under [parallel], where it sits in the mesh (or whose ranks it
borrows), its part in the facts the layout derives (the batch split, FSDP's mesh, the loss divisor), its checks
and what it does to the model. Everything here is derived from those declarations, so that a degree is added by
its file alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Protocol

from keel.config import Config, FaultToleranceConfig, ParallelConfig
from keel.config.sections import add_option
from keel.core.registry import Registry
from keel.errors import ConfigError


class Applier(Protocol):
    """What a degree does to the model (a `keel.model.parallelizable.Parallelizable`) under a
    `keel.parallel.layout.Layout` where its degree is above 1, before tensor parallelism: it calls the model's hook.
    It returns the modules whose parameters it split over its ranks, each with the mesh FSDP shards it over
    (FSDP shards the rest over the layout's `fsdp`). Typed loosely: this module imports no torch."""

    def __call__(self, model: Any, layout: Any, cfg: ParallelConfig, /) -> list[tuple[Any, Any]]: ...


@dataclass(frozen=True)
class DegreeSpec:
    """A degree of the layout: how many ranks along one dimension, and what they do."""

    name: str
    after: str = ""  # the mesh dimension it sits just inside of (registered degrees; keel's own are in order)
    borrows: tuple[str, ...] = ()  # no dimension of its own: it splits the ranks of these (its degree divides them)
    splits: str = ""  # a borrowed degree's work, as the layout's description names it ("experts")
    splits_batch: bool = False  # its ranks hold different sequences of the global batch; else the same ones
    parameters: Literal["shard", "replicate", ""] = ""  # FSDP shards parameters over it, or HSDP replicates them
    in_loss: bool = False  # each of its ranks adds a mean loss to the step's sum: the loss divisor counts it
    option: Any = None  # parallel.NAME, declared with keel.config.option (keel's own: fields of the schema)
    check_config: Callable[[Config, int], None] | None = None  # across the config's fields, as it is loaded
    check: Callable[[Config, Degrees], None] | None = None  # against the config and the resolved degrees
    apply: Applier | None = None  # what it asks of the model (its hook), called where its degree is above 1
    hook: str = ""  # the name of that hook, a method of keel.model.parallelizable.Parallelizable

    @property
    def in_mesh(self) -> bool:
        return not self.borrows

    @property
    def own(self) -> bool:
        """One of keel's own degrees, an option of the schema (a registered one brings its option)."""
        return self.option is None


# Keel's own degrees, outermost first: tensor parallel innermost (the fastest links).
BUILTIN = (
    DegreeSpec("pp"),
    DegreeSpec("dp_replicate", splits_batch=True, parameters="replicate", in_loss=True),
    DegreeSpec("dp_shard", splits_batch=True, parameters="shard", in_loss=True),
    DegreeSpec("tp", in_loss=True),
)
_OWN = {spec.name for spec in BUILTIN}

DEGREES: Registry[DegreeSpec] = Registry("keel.parallel.dims", "degree")


def degree(name: str, option: Any, **facts: Any) -> DegreeSpec:
    """Declares the degree `name` (called by its module of keel.parallel.dims as it is imported): its option
    `parallel.NAME`, declared with keel.config.option, and the facts of `DegreeSpec`. It sits in the mesh
    `after` a dimension, or `borrows` the ranks of others."""
    spec = DegreeSpec(name, option=option, **facts)
    if bool(spec.after) == bool(spec.borrows):
        raise TypeError(f"the degree {name!r} needs either its place in the mesh (after=) or the dimensions it "
                        f"borrows (borrows=)")
    if spec.parameters == "replicate" or (spec.splits_batch and not spec.parameters):
        raise TypeError(f"the degree {name!r}: HSDP's replicas are dp_replicate's, and ranks that split the batch "
                        f"average their gradients (parameters='shard')")
    add_option(ParallelConfig, name, int, option,
               None if spec.check_config is None else _config_check(name, spec.check_config))
    DEGREES.add(name, spec)
    return spec


def _config_check(name: str, check: Callable[[Config, int], None]) -> Callable[[Any], None]:
    return lambda cfg: check(cfg, int(getattr(cfg.parallel, name)))


def all_degrees() -> tuple[DegreeSpec, ...]:
    """Every degree: the mesh's dimensions outermost first, then those that borrow their ranks. Registered ones
    placed after the same dimension follow it in the order of their names."""
    specs, registered = list(BUILTIN), DEGREES.all()
    placed = {spec.name: 0 for spec in specs}  # dimension → the registered ones placed after it so far
    pending = [spec for spec in registered.values() if spec.in_mesh]
    while pending:
        spec = next((s for s in pending if s.after in placed), None)
        if spec is None:
            raise TypeError(f"the degree {pending[0].name!r} sits after {pending[0].after!r}, no dimension of the "
                            f"mesh")
        at = [s.name for s in specs].index(spec.after) + 1 + placed[spec.after]
        specs.insert(at, spec)
        placed[spec.after] += 1
        placed[spec.name] = 0
        pending.remove(spec)
    return (*specs, *(spec for spec in registered.values() if not spec.in_mesh))


def given(p: ParallelConfig, name: str) -> int:
    """The degree `name` as the config gives it (dp_shard may be -1: the processes left over)."""
    return int(getattr(p, name))


@dataclass(frozen=True)
class Degrees:
    """The product of the mesh's degrees (pp × dp_replicate × dp_shard × cp × tp, ...) = world size."""

    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int = 1
    pp_microbatches: int = 0  # pipeline micro-batches per step and data-parallel rank
    registered: Mapping[str, int] = field(default_factory=dict)  # the registered degrees, by name; 1 where absent
    specs: tuple[DegreeSpec, ...] = field(default_factory=all_degrees, compare=False, repr=False)

    def __post_init__(self) -> None:  # a degree of 1 is the same layout as one left out
        object.__setattr__(self, "registered", {k: v for k, v in sorted(self.registered.items()) if v != 1})

    @property
    def cp(self) -> int:
        return self.of("cp")

    @property
    def ep(self) -> int:
        """Experts split over ep ranks of dp_shard × cp: not a dimension of its own in the product."""
        return self.of("ep")

    def of(self, dim: str) -> int:
        return int(getattr(self, dim)) if dim in _OWN else self.registered.get(dim, 1)

    @property
    def dims(self) -> tuple[str, ...]:
        """The mesh's dimensions, outermost first."""
        return tuple(spec.name for spec in self.specs if spec.in_mesh)

    def named(self, spec: DegreeSpec) -> bool:
        """Whether the layout names the degree: keel's own always, a registered one where it is above 1."""
        return spec.own or self.of(spec.name) > 1

    def product(self, chosen: Callable[[DegreeSpec], bool]) -> int:
        return math.prod(self.of(spec.name) for spec in self.specs if spec.in_mesh and chosen(spec))

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many ways the global batch is split (the ranks of a context- or
        tensor-parallel group share their sequences)."""
        return self.product(lambda spec: spec.splits_batch)

    @property
    def world_size(self) -> int:
        return self.product(lambda spec: True)

    def describe(self) -> str:
        parts = [f"{dim}{self.of(dim)}" for dim in self.dims if self.of(dim) > 1]
        layout = " × ".join(parts) if parts else "single process"
        return layout + "".join(f", {spec.splits} over {spec.name}{self.of(spec.name)}" for spec in self.specs
                                if not spec.in_mesh and self.of(spec.name) > 1)


def _product(cfg: Config, specs: tuple[DegreeSpec, ...], dp_shard: int | str) -> tuple[str, str]:
    """'pp × dp_replicate × dp_shard × tp' and its numbers, a registered degree named only when used."""
    values = {spec.name: dp_shard if spec.name == "dp_shard" else given(cfg.parallel, spec.name) for spec in specs
              if spec.in_mesh and (spec.own or given(cfg.parallel, spec.name) > 1)}
    return " × ".join(values), " × ".join(str(value) for value in values.values())


def resolve_degrees(cfg: Config, world_size: int) -> Degrees:
    """Check the layout against the world size and the model before any process group exists."""
    p, t, specs = cfg.parallel, cfg.train, all_degrees()
    if p.dp_shard == 0:
        raise ConfigError("parallel.dp_shard = 0: expected a positive degree or -1 (the processes left over)")
    others = math.prod(given(p, spec.name) for spec in specs if spec.in_mesh and spec.name != "dp_shard")
    fixed = others * (p.dp_shard if p.dp_shard > 0 else 1)
    if world_size % fixed:
        dims, values = _product(cfg, specs, p.dp_shard if p.dp_shard > 0 else "-1")
        raise ConfigError(f"parallel degrees {dims} = {values} do not divide the {world_size} processes")
    dp_shard = p.dp_shard if p.dp_shard > 0 else world_size // fixed
    registered = {spec.name: given(p, spec.name) for spec in specs if not spec.own}
    degrees = Degrees(p.dp_replicate, dp_shard, p.tp, p.pp, 0, registered, specs)
    per_rank = t.global_batch // degrees.dp if t.global_batch % degrees.dp == 0 else 0
    degrees = replace(degrees, pp_microbatches=p.pp_microbatches or (per_rank // t.micro_batch if p.pp > 1 else 0))
    if degrees.world_size != world_size:
        _refuse_product(cfg, degrees, world_size)
    if t.param_dtype == "bf16" and world_size > 1:
        raise ConfigError(f"train.param_dtype = 'bf16' is for one process; with {world_size} processes FSDP's mixed "
                          f"precision already computes on bf16 weights gathered from fp32 shards: set "
                          f"train.param_dtype = 'fp32'")
    if p.pp > 1:
        _check_pipeline(cfg, degrees, per_rank)
    _check_heads(cfg)
    for spec in specs:
        if spec.check is not None:
            spec.check(cfg, degrees)
    _check_sequence(cfg)
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


def _refuse_product(cfg: Config, degrees: Degrees, world_size: int) -> None:
    """The mesh's product is not the world size: what would fill it, and that a borrowed degree is no factor."""
    dims, values = _product(cfg, degrees.specs, degrees.dp_shard)
    others = degrees.world_size // degrees.dp_shard
    fill = f"; parallel.dp_shard = {world_size // others} would fill them" if world_size % others == 0 else ""
    borrowed = "".join(f" (parallel.{spec.name} is no factor: its ranks are borrowed from {' × '.join(spec.borrows)})"
                       for spec in degrees.specs if not spec.in_mesh and degrees.of(spec.name) > 1)
    raise ConfigError(f"parallel degrees {dims} = {values} = {degrees.world_size}, but there are {world_size} "
                      f"processes; the product must equal them{fill}{borrowed}")


def _check_heads(cfg: Config) -> None:
    """Tensor parallel splits the attention heads."""
    tp, m = cfg.parallel.tp, cfg.model
    for name, value in (("model.n_heads", m.n_heads), ("model.n_kv_heads", m.n_kv_heads)):
        if value % tp:
            raise ConfigError(f"{name} = {value} must divide by parallel.tp = {tp}")


def _check_sequence(cfg: Config) -> None:
    """Sequence parallelism splits each sequence over tensor parallel (a degree that splits the sequence first,
    as context parallelism does, checks its share)."""
    if cfg.train.seq_len % cfg.parallel.tp:
        raise ConfigError(f"train.seq_len = {cfg.train.seq_len} must divide by parallel.tp = {cfg.parallel.tp}")


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
