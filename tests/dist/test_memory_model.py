"""The memory model against keel's own measured peak memory: real `keel train` runs on this CPU in six of
bench/memory_model.py's layouts (the loss by cross entropy, FSDP, TP, PP and experts split over expert-parallel
ranks; the bench adds activation checkpointing, full and selective, whose runs are the slowest here, a wider
model and two more mixture-of-experts layouts), each rank's peak resident memory above what it held
before building its model, within ±15% of what `keel.plan.memory` predicts from the run's config and layout.

glibc's allocator runs with MALLOC_MMAP_THRESHOLD_, so that freed tensors leave the resident set and it
follows what is allocated (the allocator's own fragmentation is the planner's separate headroom factor,
measured by the bench)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.memory_model import CONFIGS, MIB, TIGHT, measure_all
from keel.plan.memory import MemoryCheck

pytestmark = [pytest.mark.dist, pytest.mark.slow]
TESTED = {name: CONFIGS[name] for name in ("one", "fused_ce", "fsdp2", "tp2", "pp2", "moe_ep2")}


@pytest.fixture(scope="module")
def checks(small_corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, MemoryCheck]:
    return measure_all(small_corpus, tmp_path_factory.mktemp("memory"), TESTED, TIGHT)


@pytest.mark.parametrize("name", list(TESTED))
def test_the_memory_model_predicts_the_measured_peak_within_15_percent(name: str, checks: dict) -> None:
    check = checks[name]
    print(f"{name}: predicted {check.predicted.total / MIB:.0f} MiB, measured {check.measured / MIB:.0f} MiB "
          f"({check.error:+.1%})")
    assert check.measured > 300 * MIB, "the run's own memory dominates what is compared"
    assert abs(check.error) <= 0.15, (check.predicted, check.measured / MIB)


def test_the_fused_cross_entropy_lowers_the_measured_peak_as_predicted(checks: dict) -> None:
    torch_ce, fused = checks["one"], checks["fused_ce"]
    predicted = torch_ce.predicted.total - fused.predicted.total
    assert predicted > 0
    assert torch_ce.measured - fused.measured == pytest.approx(predicted, rel=0.5)
