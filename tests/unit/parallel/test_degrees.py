"""Layouts are resolved and checked before any process group exists; each invalid one is refused
with a one-line message naming the constraint and the numbers."""

from __future__ import annotations

import re

import pytest

from keel.config import load_config
from keel.errors import ConfigError
from keel.parallel.degrees import Degrees, resolve_degrees

BASE = ["model.n_heads=8", "model.n_kv_heads=4", "train.seq_len=256", "train.global_batch=32",
        "train.micro_batch=4", "eval.sequences=64"]
MOE = ["model.moe.experts=8", "model.moe.top_k=2"]


@pytest.mark.parametrize(("world", "overrides", "expect"), [
    (1, [], Degrees(1, 1, 1)),
    (4, [], Degrees(1, 4, 1)),
    (4, ["parallel.tp=2"], Degrees(1, 2, 2)),
    (8, ["parallel.dp_replicate=2", "parallel.tp=2"], Degrees(2, 2, 2)),
    (4, ["parallel.dp_replicate=4", "parallel.dp_shard=1"], Degrees(4, 1, 1)),
    (2, ["parallel.tp=2", "parallel.dp_shard=1"], Degrees(1, 1, 2)),
    # Pipeline: micro-batches default to the per-rank batch over train.micro_batch (32 / 2 / 4).
    (4, ["parallel.pp=2"], Degrees(1, 2, 1, 2, 4)),
    (8, ["parallel.pp=2", "parallel.tp=2", "parallel.pp_microbatches=2"], Degrees(1, 2, 2, 2, 2)),
])
def test_valid_layouts_resolve(world: int, overrides: list[str], expect: Degrees) -> None:
    layout = resolve_degrees(load_config(None, BASE + overrides), world)
    assert layout == expect
    assert layout.world_size == world and layout.dp == expect.dp_replicate * expect.dp_shard


@pytest.mark.parametrize(("world", "overrides", "expect"), [
    (2, ["parallel.cp=2"], Degrees(1, 1, 1, registered={"cp": 2})),
    (8, ["parallel.cp=2", "parallel.tp=2"], Degrees(1, 2, 2, registered={"cp": 2})),
    (8, ["parallel.cp=2", "parallel.pp=2"], Degrees(1, 2, 1, 2, 4, registered={"cp": 2})),
])
def test_context_parallel_degrees_resolve(world: int, overrides: list[str], expect: Degrees) -> None:
    degrees = resolve_degrees(load_config(None, BASE + overrides), world)
    assert degrees == expect and degrees.world_size == world
    assert "cp2" in degrees.describe()


@pytest.mark.parametrize(("world", "overrides", "expect"), [
    (6, ["parallel.cp=4"], "pp × dp_replicate × dp_shard × cp × tp = 1 × 1 × -1 × 4 × 1 do not divide the 6"),
    (4, ["parallel.cp=2", "train.seq_len=250"], "train.seq_len = 250 must divide by 2 × parallel.cp = 4"),
    (8, ["parallel.cp=2", "parallel.tp=4", "train.seq_len=252"],
     "train.seq_len / parallel.cp = 126 must divide by parallel.tp = 4"),
])
def test_context_parallel_layouts_are_refused_with_their_numbers(world: int, overrides: list[str],
                                                                 expect: str) -> None:
    with pytest.raises(ConfigError) as info:
        resolve_degrees(load_config(None, BASE + overrides), world)
    assert expect in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("overrides", [
    ["parallel.compile=true"],
    ["monitor.signals_interval=5"],
    ['eval.downstream_tasks=["keel_stdlib_heldout"]'],
], ids=["compile", "signals", "downstream"])
def test_context_parallelism_loads_with_what_runs_exactly_beside_it(overrides: list[str]) -> None:
    """Each runs exactly beside context parallelism (tests/dist/test_context_parallel_features.py)."""
    assert load_config(None, [*BASE, "parallel.cp=2", *overrides]).parallel.cp == 2


@pytest.mark.parametrize(("world", "overrides", "expect"), [
    (4, ["parallel.tp=3"], "pp × dp_replicate × dp_shard × tp = 1 × 1 × -1 × 3 do not divide the 4 processes"),
    (4, ["parallel.dp_shard=3"], "pp × dp_replicate × dp_shard × tp = 1 × 1 × 3 × 1 do not divide the 4 processes"),
    (8, ["parallel.dp_shard=2", "parallel.tp=2"],
     "pp × dp_replicate × dp_shard × tp = 1 × 1 × 2 × 2 = 4, but there are 8 processes; the product must equal "
     "them; parallel.dp_shard = 4 would fill them"),
    (4, [*MOE, "parallel.ep=2", "parallel.dp_shard=2"],
     "= 2, but there are 4 processes; the product must equal them; parallel.dp_shard = 4 would fill them "
     "(parallel.ep is no factor: its ranks are borrowed from dp_shard × cp)"),
    (4, ["parallel.dp_shard=0"], "parallel.dp_shard = 0: expected a positive degree or -1"),
    (4, ["parallel.tp=4", "model.n_kv_heads=2"], "model.n_kv_heads = 2 must divide by parallel.tp = 4"),
    (8, ["parallel.tp=8", "model.dim=96", "model.n_heads=6", "model.n_kv_heads=2"],
     "model.n_heads = 6 must divide by parallel.tp = 8"),
    (4, ["parallel.tp=4", "model.n_kv_heads=4", "train.seq_len=254"],
     "train.seq_len = 254 must divide by parallel.tp = 4"),
    (16, ["train.global_batch=32", "train.micro_batch=4"],
     "train.global_batch = 32 must divide by train.micro_batch × data-parallel degree = 4 × 16"),
    (4, ["parallel.dp_replicate=2", "eval.sequences=6"],
     "eval.sequences = 6 must divide by the data-parallel degree = 4"),
    (4, ["parallel.pp=4", "model.n_layers=3"],
     "model.n_layers = 3 cannot fill pp × pp_stages_per_rank = 4 × 1 stages of at least one block each"),
    (2, ["parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b"],
     "parallel.pp_schedule = 'interleaved_1f1b' needs parallel.pp_stages_per_rank >= 2, not 1"),
    (2, ["parallel.pp=2", "parallel.pp_stages_per_rank=2"],
     "parallel.pp_schedule = '1f1b' runs one stage per rank, but parallel.pp_stages_per_rank = 2"),
    (2, ["parallel.pp=2", "model.tie_embeddings=true"], "model.tie_embeddings = true cannot be pipelined"),
    (4, ["parallel.pp=4", "train.micro_batch=16"], "parallel.pp_microbatches = 2 must be at least parallel.pp = 4"),
    (2, ["parallel.pp=2", "parallel.pp_microbatches=3"],
     "the global batch per data-parallel rank (32 / 1) must split into parallel.pp_microbatches = 3"),
    (2, ["parallel.pp=2", "parallel.pp_microbatches=32", "train.micro_batch=1", "eval.sequences=48"],
     "eval.sequences per data-parallel rank (48) must divide into parallel.pp_microbatches = 32"),
])
def test_invalid_layouts_are_refused_with_their_numbers(world: int, overrides: list[str], expect: str) -> None:
    with pytest.raises(ConfigError) as info:
        resolve_degrees(load_config(None, BASE + overrides), world)
    message = str(info.value)
    assert expect in message and "\n" not in message


def test_degrees_describe_themselves() -> None:
    assert Degrees(2, 2, 2).describe() == "dp_replicate2 × dp_shard2 × tp2"
    assert Degrees(1, 2, 1, 2, 4).describe() == "pp2 × dp_shard2"
    assert Degrees(1, 1, 1).describe() == "single process"


def test_resolve_degrees() -> None:
    cfg = load_config(None, ["train.global_batch=32", "train.micro_batch=8", "eval.sequences=64"])
    for world_size in (1, 2, 4):
        resolve_degrees(cfg, world_size)
    with pytest.raises(ConfigError) as info:
        resolve_degrees(cfg, 3)
    message = str(info.value)
    assert "\n" not in message
    assert "train.global_batch = 32 must divide by train.micro_batch × data-parallel degree = 8 × 3" in message
    assert "multiple of 24" in message
    with pytest.raises(ConfigError, match="multiple of 64"):
        resolve_degrees(cfg, 8)
    # The batch splits over 3 processes but the validation set does not.
    cfg = load_config(None, ["train.global_batch=48", "train.micro_batch=16", "eval.sequences=64"])
    with pytest.raises(ConfigError) as info:
        resolve_degrees(cfg, 3)
    assert "eval.sequences = 64 must divide by the data-parallel degree = 3" in str(info.value)



@pytest.mark.parametrize(("world", "overrides", "expect"), [
    (4, ["parallel.ep=2"], Degrees(1, 4, 1, registered={"ep": 2})),
    (4, ["parallel.ep=4"], Degrees(1, 4, 1, registered={"ep": 4})),
    # borrowed from dp_shard × cp
    (4, ["parallel.cp=2", "parallel.ep=4"], Degrees(1, 2, 1, registered={"cp": 2, "ep": 4})),
    (8, ["parallel.dp_replicate=2", "parallel.ep=2"], Degrees(2, 4, 1, registered={"ep": 2})),
])
def test_expert_parallel_degrees_borrow_their_ranks(world: int, overrides: list[str], expect: Degrees) -> None:
    degrees = resolve_degrees(load_config(None, BASE + MOE + overrides), world)
    assert degrees == expect and degrees.world_size == world


@pytest.mark.parametrize(("world", "overrides", "expect"), [
    (4, [*MOE, "parallel.ep=8"], "parallel.ep = 8 must divide dp_shard = 4"),
    (4, [*MOE, "parallel.ep=4", "parallel.dp_replicate=2"], "parallel.ep = 4 must divide dp_shard = 2"),
    (4, [*MOE, "parallel.ep=4", "parallel.cp=2", "parallel.dp_replicate=2"],
     "parallel.ep = 4 must divide dp_shard × cp = 1 × 2"),
])
def test_expert_parallel_degrees_that_do_not_divide_their_lenders_are_refused(world: int, overrides: list[str],
                                                                              expect: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(expect)):
        resolve_degrees(load_config(None, BASE + overrides), world)


@pytest.mark.parametrize(("overrides", "expect"), [
    (["parallel.ep=2"], "parallel.ep = 2 splits routed experts, but the model has none"),
    (["model.moe.experts=6", "model.moe.top_k=2", "parallel.ep=4"],
     "model.moe.experts = 6 must divide by parallel.ep = 4"),
])
def test_an_expert_parallel_degree_the_model_cannot_take_is_refused(overrides: list[str], expect: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(expect)):
        load_config(None, BASE + overrides)


def test_expert_parallelism_is_named_in_the_layout() -> None:
    assert Degrees(1, 4, 1, registered={"ep": 2}).describe() == "dp_shard4, experts over ep2"
