"""The memory model (keel.plan.memory) against keel's own measured peak memory, and what the fused cross
entropy saves.

Each configuration is a real `keel train` run on this CPU: layouts (one process, FSDP, TP, PP), activation
checkpointing modes, both cross entropies, two model sizes, a mixture of experts (whole, FSDP-sharded and
split over 2 expert-parallel ranks). A run reports, per rank, its peak resident
memory above what the rank held before building its model (`memory/above_runtime_bytes_max_rank`, the
largest rank's); `keel.plan.memory.check_run` predicts the same from the run's config and layout. Runs
last 5 steps, with a checkpoint and an in-memory snapshot every 2, so that the host copies of the state
(checkpoint staging, two snapshots) are in place as in a long run.

Two allocators: glibc's default keeps freed heap memory resident (its fragmentation, which the planner's
headroom factor stands for); with MALLOC_MMAP_THRESHOLD_ every block above 128 KiB is a mapping of its
own, returned when freed, and the resident set follows what is allocated, which is what the model counts
(the test runs that one, tests/dist/test_memory_model.py). The fused cross entropy is measured before and
after at larger vocabularies too, where the logits dominate. Results: a table and
bench/results/memory_model.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from keel.plan.memory import MemoryCheck, check_run

RESULTS = Path(__file__).parent / "results" / "memory_model.json"
MIB = 2**20
TIGHT = {"MALLOC_MMAP_THRESHOLD_": "131072"}  # glibc: blocks above 128 KiB are their own mappings
# Five steps, a checkpoint and a snapshot every two: the host copies are all in place by the last step.
RUN = ["model.dim=256", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=2", "model.vocab_size=8192",
       "model.max_seq_len=512", "train.seq_len=512", "train.global_batch=8", "train.micro_batch=4", "train.steps=5",
       "optim.warmup_steps=1", "monitor.interval=1", "eval.interval=0", "eval.sequences=8", "checkpoint.interval=2",
       "guard.snapshot_interval=2", "health.preflight_probe_mib=4"]
MOE = ["model.moe.experts=8", "model.moe.top_k=2", "model.moe.dense_layers=1"]
CONFIGS: dict[str, tuple[int, list[str]]] = {
    "one": (1, []),
    "fused_ce": (1, ["train.cross_entropy=fused"]),
    "ac_full": (1, ["parallel.activation_checkpoint=full"]),
    "ac_selective": (1, ["parallel.activation_checkpoint=selective"]),
    "fsdp2": (2, []),
    "tp2": (2, ["parallel.tp=2", "parallel.dp_shard=1"]),
    "pp2": (2, ["parallel.pp=2"]),
    "wider": (1, ["model.dim=384", "model.n_layers=6", "train.seq_len=256", "train.micro_batch=8"]),
    # A mixture of experts (2.2x the dense model's parameters): all experts on each rank, FSDP-sharded, or split.
    "moe": (1, MOE),
    "moe_fsdp2": (2, MOE),
    "moe_ep2": (2, [*MOE, "parallel.ep=2"]),
}
# The fused cross entropy before and after, where the logits are most of the peak.
VOCABS = (32768, 65536)


def measure(corpus: Path, run_dir: Path, nproc: int, overrides: list[str], env: dict[str, str],
            timeout: float = 600) -> MemoryCheck:
    """Train one configuration; its measured peak beside the model's prediction."""
    cmd = [sys.executable, "-m", "keel", "train", "--quiet", "--nproc", str(nproc), "--run-dir", str(run_dir), *RUN,
           f"data.dir={corpus}", *overrides]
    full_env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), **env)
    result = subprocess.run(cmd, capture_output=True, text=True, env=full_env, timeout=timeout)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{result.stderr[-3000:]}")
    return check_run(run_dir)


def measure_all(corpus: Path, root: Path, configs: dict[str, tuple[int, list[str]]], env: dict[str, str],
                concurrent: int = 2) -> dict[str, MemoryCheck]:
    """Every configuration, `concurrent` runs at a time (memory is per process: they do not disturb it)."""
    def one(name: str) -> MemoryCheck:
        nproc, overrides = configs[name]
        return measure(corpus, root / name, nproc, overrides, env)

    with ThreadPoolExecutor(max_workers=concurrent) as pool:
        return dict(zip(configs, pool.map(one, configs), strict=True))


def row(check: MemoryCheck) -> dict:
    p = check.predicted
    return {"layout": p.layout.describe(), "measured_mib": check.measured / MIB, "predicted_mib": p.total / MIB,
            "error": check.error, "parts_mib": {k: getattr(p, k) / MIB for k in (
                "params", "grads", "optimizer", "activations", "pipeline_inflight", "backward", "buffers", "host")}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--corpus", type=Path, default=None, help="a prepared corpus (default: the tests' small one)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="keel-bench-memory-") as tmp:
        root = Path(tmp)
        corpus = args.corpus or prepare_small(root / "corpus")
        tight = measure_all(corpus, root / "tight", CONFIGS, TIGHT)
        default = measure_all(corpus, root / "default", CONFIGS, {})
        vocab = {f"vocab{v}_{kind}": (1, [f"model.vocab_size={v}", f"train.cross_entropy={kind}"])
                 for v in VOCABS for kind in ("torch", "fused")}
        ce = measure_all(corpus, root / "ce", vocab, TIGHT)
    print(f"{'configuration':<16}{'layout':<24}{'predicted':>10}{'measured':>10}{'error':>8}{'glibc default':>15}"
          f"{'fragmentation':>15}")
    for name, check in tight.items():
        frag = default[name].measured / check.measured - 1
        print(f"{name:<16}{check.predicted.layout.describe():<24}{check.predicted.total / MIB:>10.0f}"
              f"{check.measured / MIB:>10.0f}{check.error:>+8.1%}{default[name].measured / MIB:>15.0f}{frag:>+15.1%}")
    print(f"\n{'cross entropy':<22}{'predicted':>10}{'measured':>10}{'error':>8}")
    for name, check in ce.items():
        print(f"{name:<22}{check.predicted.total / MIB:>10.0f}{check.measured / MIB:>10.0f}{check.error:>+8.1%}")
    saved = {v: ce[f"vocab{v}_fused"].measured / ce[f"vocab{v}_torch"].measured for v in VOCABS}
    print("fused over torch, measured peak: " + ", ".join(f"vocab {v}: {r:.2f}" for v, r in saved.items()))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "benchmark": "memory_model", "run": RUN,
        "configs": {k: {"nproc": n, "overrides": o} for k, (n, o) in CONFIGS.items()},
        "tight": {k: row(v) for k, v in tight.items()}, "default_allocator": {k: row(v) for k, v in default.items()},
        "cross_entropy": {k: row(v) for k, v in ce.items()}, "fused_over_torch": saved,
        "machine": platform.machine(), "cpus": os.cpu_count(), "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }, indent=1) + "\n")


def prepare_small(out: Path) -> Path:
    """The tests' small corpus (a few of the standard library's modules, byte tokenizer)."""
    from keel.data.prepare import prepare
    from tests.conftest import SMALL_SOURCES, small_data

    prepare(small_data(SMALL_SOURCES), out)
    return out


if __name__ == "__main__":
    main()
