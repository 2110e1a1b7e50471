"""Context parallelism in the planner: a sequence split over cp ranks divides every per-token activation by cp,
adds the gathered K/V of one block and the exchange that gathers it, shards the state over dp_shard × cp, and
is searched where sequences are long or nothing fits without it."""

from __future__ import annotations

from functools import cache

import pytest

from keel.config import ModelConfig, load_config
from keel.core.accelerators import by_key
from keel.errors import KeelError
from keel.plan.layout import Layout, Workload, config_layout, parse_layout
from keel.plan.throughput import Efficiency
from tests.conftest import REPO

H100 = by_key("h100")
EXACT = Efficiency(compute=1.0, overlap=0.0, link=1.0)
MIB = 2**20


@cache
def model(name: str) -> ModelConfig:
    return load_config(REPO / "configs" / f"{name}.toml", []).model


def long_context(seq: int, batch: int = 32) -> Workload:
    return Workload(model("llama3_8b"), seq, batch)


def test_a_layout_string_takes_cp_and_the_layout_names_it() -> None:
    layout = parse_layout("tp=2,cp=4", 64)
    assert layout == Layout(tp=2, cp=4, dp_shard=8) and layout.gpus() == 64
    assert layout.dp() == 8 and layout.shard() == 32  # the batch splits over dp; the state over dp_shard × cp
    assert layout.describe() == "tp2 cp4 dp_shard8 mb1"
    assert "cp=4" in layout.spec() and parse_layout(layout.spec(), 64) == layout
    assert "cp" not in Layout(tp=2, dp_shard=4).describe()
    with pytest.raises(KeelError, match=r"tp × pp × dp_replicate × cp = 128 does not divide --gpus 64"):
        parse_layout("tp=8,cp=16", 64)
    with pytest.raises(KeelError, match=r"uses 32 devices \(tp × pp × dp_shard × dp_replicate × cp\), not --gpus 64"):
        parse_layout("cp=4,dp_shard=8", 64)
    with pytest.raises(KeelError, match="cp=0: expected a positive whole number"):
        parse_layout("cp=0", 64)


def test_a_config_s_parallel_cp_is_the_given_layout_s() -> None:
    cfg = load_config(REPO / "configs" / "llama3_8b.toml", ["parallel.tp=2"])
    assert config_layout(cfg, 64)[0] == Layout(tp=2, dp_shard=32)  # no parallel.cp: none
    cfg.parallel.cp = 4  # type: ignore[attr-defined]  # what parallel.cp = 4 gives
    assert config_layout(cfg, 64)[0] == Layout(tp=2, cp=4, dp_shard=8)
