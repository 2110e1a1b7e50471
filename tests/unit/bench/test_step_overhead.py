"""bench/step_overhead.py's reading of a run's records and its ratios, on files whose figures are known by hand;
and bench/bare_loop.py's data order, which must be keel's loader's."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from bench.bare_loop import SequenceOrder
from bench.step_overhead import bare_steps, cost, keel_steps, markdown, ratios, steady_step_s
from keel.data.loader import GlobalOrderLoader


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_the_steady_state_starts_at_the_warmup_step_and_ends_at_the_last(tmp_path: Path) -> None:
    # keel's records every 10 steps, a validation record without a time between them; step 1 took 5 s.
    run = tmp_path / "keel"
    run.mkdir()
    write_jsonl(run / "metrics.jsonl", [{"step": 10, "time": 114.0, "train/loss": 3.0},
                                        {"step": 10, "val/loss": 3.1},
                                        {"step": 20, "time": 124.0, "train/loss": 2.0},
                                        {"step": 30, "time": 136.0, "train/loss": 1.0}])
    write_jsonl(run / "events.jsonl", [{"time": 100.0, "kind": "start", "action": ""},
                                       {"time": 105.0, "kind": "step", "action": "first"}])
    steps, first = keel_steps(run)
    assert first == 105.0
    assert steady_step_s(steps, 10) == pytest.approx(22.0 / 20)
    assert steady_step_s(steps, 11) == pytest.approx(12.0 / 10)  # from the first record after the warm-up
    with pytest.raises(SystemExit, match="more --steps"):
        steady_step_s(steps, 21)


def test_the_bare_loops_first_step_is_its_first_step_record(tmp_path: Path) -> None:
    out = write_jsonl(tmp_path / "bare.jsonl", [{"started": 99.0}, *({"step": s, "time": 100.0 + 2 * s, "loss": 1.0}
                                                                    for s in range(1, 31))])
    steps, first = bare_steps(out)
    assert first == 102.0
    assert steady_step_s(steps, 10) == pytest.approx(2.0)


def fig(step_s: float, cpu_s: float, first_step_s: float, wall_s: float) -> dict[str, float]:
    return {"step_s": step_s, "cpu_s": cpu_s, "first_step_s": first_step_s, "wall_s": wall_s}


PAIRS = [
    {"bare": fig(1.0, 10.0, 4.0, 20.0), "defaults": fig(1.1, 12.0, 6.0, 30.0), "no guards": fig(1.05, 11.0, 6.0, 28.0)},
    {"bare": fig(2.0, 10.0, 4.0, 20.0), "defaults": fig(2.1, 13.0, 5.0, 24.0), "no guards": fig(2.0, 12.0, 5.0, 24.0)},
    {"bare": fig(1.0, 20.0, 5.0, 20.0), "defaults": fig(1.2, 22.0, 5.0, 22.0), "no guards": fig(1.0, 20.0, 5.0, 20.0)},
]


def test_ratios_are_taken_within_each_repeat() -> None:
    got = ratios(PAIRS, "defaults")
    assert got["step_s"]["ratios"] == pytest.approx([1.10, 1.05, 1.20])
    assert (got["step_s"]["ratio"], got["step_s"]["min"], got["step_s"]["max"]) == pytest.approx((1.10, 1.05, 1.20))
    assert got["step_s"]["keel"] == pytest.approx(1.20) and got["step_s"]["bare"] == 1.0  # each side's own median
    assert got["first_step_s"]["ratio"] == pytest.approx(1.25)


def test_a_features_cost_is_what_turning_it_off_saves_against_the_bare_loop() -> None:
    got = cost(PAIRS, "no guards")
    assert got["step_s"] == pytest.approx(0.05)  # median of 0.05, 0.05, 0.20
    assert got["cpu_s"] == pytest.approx(0.1)  # median of 0.1, 0.1, 0.1
    assert got["wall_s"] == pytest.approx(0.1)  # median of 0.1, 0, 0.1


def test_the_tables_show_each_cell_and_the_attribution() -> None:
    results = {"repeats": 3, "steps": 30, "warmup": 10, "overrides": ["model.dim=64"], "targets": {"step_s": 1.03},
               "cells": [
        {"shape": "tiny", "nproc": 2, "variants": {"defaults": ratios(PAIRS, "defaults"),
                                                   "no guards": ratios(PAIRS, "no guards")}, "runs": PAIRS}]}
    text = markdown(results)
    assert text.startswith("30 steps a run, steps 10 to 30 the steady state; both sides with `model.dim=64`:")
    assert "| tiny | 2 | steady-state step, s | 1.200 | 1.000 | **1.100** (1.050–1.200) | 1.03 |" in text
    assert "| no guards | **1.000** (1.000–1.050) |" in text and "| +0.050 | +0.100 | +0.000 | +0.100 |" in text


def test_the_bare_loop_reads_the_global_batches_of_keels_loader(tmp_path: Path) -> None:
    # Two shards of different lengths, and enough batches to cross into the second epoch.
    rng = np.random.default_rng(0)
    shards = [rng.integers(0, 259, n).astype(np.uint16) for n in (1000, 601)]
    files = []
    for i, tokens in enumerate(shards):
        name = f"main-train-{i:05d}.bin"
        tokens.tofile(tmp_path / name)
        files.append({"name": name, "source": "main", "split": "train", "tokens": len(tokens)})
    (tmp_path / "manifest.json").write_text(json.dumps({"dtype": "uint16", "files": files}))
    seq_len, global_batch, seed = 16, 8, 3
    bare = SequenceOrder(tmp_path, seq_len, global_batch, seed)
    memmaps = [np.memmap(tmp_path / f["name"], dtype=np.uint16, mode="r") for f in files]
    loader = GlobalOrderLoader(memmaps, seq_len=seq_len, global_batch=global_batch, micro_batch=global_batch,
                               dp_rank=0, dp_size=1, seed=seed, fingerprint="test")
    try:
        for number in range(14):  # 99 sequences: epoch 1 begins in batch 12
            [(inputs, targets)] = loader.next()
            assert torch.equal(torch.cat([inputs, targets[:, -1:]], 1), torch.from_numpy(bare.batch(number)))
    finally:
        loader.close()
