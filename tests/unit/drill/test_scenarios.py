"""The catalog's mixture-of-experts scenarios: a suite of their own, each a valid config on the quick suite's
small model, with the layout its guard needs."""

from __future__ import annotations

import pytest

from keel.config import load_config
from keel.drill.faults import BitFlip, parse_injection
from keel.drill.scenarios import MOE_SUITE, QUICK_SHAPE, Plan, catalog, suite

PLAN = Plan(steps=15, interval=5)


def test_the_moe_suite_is_its_scenarios_in_the_catalog_and_the_full_suite() -> None:
    assert [s.name for s in suite("moe", PLAN)] == MOE_SUITE
    assert set(MOE_SUITE) <= {s.name for s in suite("full", PLAN)}
    assert set(MOE_SUITE).isdisjoint(s.name for s in suite("quick", PLAN))


@pytest.mark.parametrize("name", MOE_SUITE)
def test_each_moe_scenario_is_an_expert_parallel_mixture_of_experts_config(name: str) -> None:
    """Checked as `keel train` checks it (a replica-group scenario with its groups: balancing biases off)."""
    s = catalog(PLAN)[name]
    groups = [f"fault_tolerance.replica_groups={s.groups}"] if s.groups > 1 else []
    cfg = load_config(None, [*QUICK_SHAPE, *s.config, *s.tuning, *groups])
    assert (cfg.model.moe.experts, cfg.parallel.ep) == (4, 2)
    assert (cfg.model.moe.bias_update_rate == 0) == (s.groups > 1)
    dp = s.nproc * s.groups if s.nproc else 2
    assert cfg.train.global_batch % (cfg.train.micro_batch * dp) == 0, "the batch splits over the ranks"


def test_the_expert_flip_lands_where_a_replica_holds_the_same_shard() -> None:
    """Two HSDP replicas of an expert-parallel pair on 4 processes: the fingerprints have a shard to compare."""
    s = catalog(PLAN)["moe_bitflip_expert"]
    cfg = load_config(None, [*QUICK_SHAPE, *s.config])
    assert s.nproc == 4 and (cfg.parallel.dp_replicate, cfg.parallel.dp_shard, cfg.parallel.ep) == (2, 2, 2)
    (spec,) = s.inject
    flip = parse_injection(spec)
    assert isinstance(flip, BitFlip) and (flip.target, flip.name, flip.step) == ("params", "layers.1.moe.experts.w1",
                                                                                 PLAN.mid)
    assert s.detect == ("guard", "rollback") and s.recovered_by == ("guard", "quarantine", {"ranks": [flip.rank]})
