"""The SDC guard on a mixture-of-experts model over 2 real processes (gloo, fp32): a replay of every step
recomputes it bit for bit and the replicas' fingerprints agree at every step, so that no guard acts, and the run
ends with the weights, biases and routing metrics of the same run unguarded (a replay's recount leaves nothing)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from keel.checkpoint.inspect import state_sha256
from keel.rundir.events import read_jsonl
from tests.dist.test_layouts import STEPS, train
from tests.dist.test_moe import MOE

pytestmark = pytest.mark.dist

# Replicated data parallelism, so that there are replicas to fingerprint; a capacity, so that the dropped tokens a
# replay would count again show.
REPLICAS = [*MOE, "model.moe.capacity_factor=1.0", "parallel.dp_replicate=2", "parallel.dp_shard=1"]
CHECKED = ["guard.sdc.replay_interval=1", "guard.sdc.fingerprint_interval=1"]


def routing(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: {k: v for k, v in r.items() if k.startswith("moe/")}
            for r in read_jsonl(run_dir / "metrics.jsonl") if "moe/imbalance_max" in r}


def train_state(run_dir: Path) -> dict:
    return json.loads((run_dir / "checkpoints" / f"step-{STEPS:06d}" / "train_state.json").read_text())


def test_replays_and_fingerprints_of_every_step_of_an_expert_model_change_nothing(small_corpus: Path,
                                                                                  tmp_path: Path) -> None:
    checked, plain = tmp_path / "checked", tmp_path / "plain"
    with ThreadPoolExecutor(max_workers=2) as pool:
        for made in [pool.submit(train, small_corpus, checked, 2, *REPLICAS, *CHECKED),
                     pool.submit(train, small_corpus, plain, 2, *REPLICAS)]:
            made.result()
    assert not [e for e in read_jsonl(checked / "events.jsonl") if e["kind"] in ("guard", "alert")
                and e["action"] not in ("moe_collapse", "moe_imbalance")]
    counts = train_state(checked)["guards"]["counts"]
    assert (counts["sdc_replays"], counts["sdc_checks"]) == (STEPS, STEPS)
    assert train_state(checked)["experts"] == train_state(plain)["experts"]
    assert routing(checked) == routing(plain) and any(
        r["moe/dropped_tokens/layer_1"] for r in routing(plain).values())
    final = f"step-{STEPS:06d}"
    assert state_sha256(checked / "checkpoints" / final) == state_sha256(plain / "checkpoints" / final)
