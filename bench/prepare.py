"""What `keel data prepare` costs: MB/s of the full prepare with 1 and 2 workers, and its peak memory as the input
grows 4×.

The input is generated: JSON-lines files (half of them gzipped) of prose-like documents drawn from a Zipf
vocabulary, a tenth of them exact copies and a tenth near copies (a few words changed), so that every stage
(cleaning, exact and MinHash dedup, decontamination, tokenizing, sharding) has work to do. Each measurement is a
fresh `keel data prepare` process; its peak memory is the largest sum of the resident memory of the process and its
workers, sampled every 20 ms. Side by side in the same run: 1 worker and 2 workers on the base input (the speed-up),
and 1 worker on the base input and on 4× the base input (the memory ratio, target well under 4: memory grows with
the number of documents' metadata, not with the bytes of text). Results: a table and bench/results/prepare.json.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import psutil

RESULTS = Path(__file__).parent / "results" / "prepare.json"
FILE_MB = 4  # input file size: many files, so that workers have something to share


def words(rng: np.random.Generator, vocabulary: list[str], n: int) -> list[str]:
    ranks = np.minimum(rng.zipf(1.2, n) - 1, len(vocabulary) - 1)
    return [vocabulary[r] for r in ranks]


def make_input(root: Path, megabytes: int, seed: int = 0) -> Path:
    """`megabytes` MB of JSON-lines documents in files of about FILE_MB MB each."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    vocabulary = ["".join(rng.choice(letters, rng.integers(2, 10))) for _ in range(50_000)]
    root.mkdir(parents=True)
    written, number, previous = 0, 0, []
    while written < megabytes * 1_000_000:
        lines, size = [], 0
        while size < FILE_MB * 1_000_000:
            kind = rng.random()
            if previous and kind < 0.1:
                doc = previous[rng.integers(len(previous))]
            elif previous and kind < 0.2:
                base = previous[rng.integers(len(previous))].split(" ")
                for i in rng.integers(0, len(base), max(1, len(base) // 50)):
                    base[i] = vocabulary[rng.integers(len(vocabulary))]
                doc = " ".join(base)
            else:
                sentences = [" ".join(words(rng, vocabulary, int(rng.integers(8, 20)))).capitalize() + "."
                             for _ in range(int(rng.integers(5, 40)))]
                doc = " ".join(sentences)
            previous = (previous + [doc])[-200:]
            line = json.dumps({"text": doc}) + "\n"
            lines.append(line)
            size += len(line)
        body = "".join(lines).encode()
        path = root / f"part-{number:04d}.jsonl"
        if number % 2:
            path.with_suffix(".jsonl.gz").write_bytes(gzip.compress(body, compresslevel=1))
        else:
            path.write_bytes(body)
        written += len(body)
        number += 1
    return root


def measure(source: Path, out: Path, workers: int, timeout: float) -> dict:
    cmd = [sys.executable, "-m", "keel", "data", "prepare", "--source", str(source), "--out", str(out),
           "--workers", str(workers), "data.val_fraction=0.01"]
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak, done = 0, threading.Event()

    def sample() -> None:
        nonlocal peak
        parent = psutil.Process(proc.pid)
        while not done.is_set():
            try:
                tree = [parent, *parent.children(recursive=True)]
                peak = max(peak, sum(p.memory_info().rss for p in tree if p.is_running()))
            except psutil.Error:
                pass
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    stdout, stderr = proc.communicate(timeout=timeout)
    seconds = time.perf_counter() - started
    done.set()
    sampler.join()
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{stderr[-2000:]}")
    source_mb = json.loads((out / "manifest.json").read_text())["source_bytes"] / 1e6
    return {"workers": workers, "source_mb": round(source_mb, 2), "seconds": round(seconds, 2),
            "mb_per_s": round(source_mb / seconds, 2), "peak_rss_mb": round(peak / 1e6, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=int, default=24, help="size of the base input in MB (the large one is 4×)")
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--keep", action="store_true", help="keep the generated inputs and corpora")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="keel-bench-prepare-"))
    try:
        base, large = make_input(work / "base", args.mb), make_input(work / "large", 4 * args.mb, seed=1)
        rows = [("1 worker, base", measure(base, work / "out-1", 1, args.timeout)),
                ("2 workers, base", measure(base, work / "out-2", 2, args.timeout)),
                ("1 worker, 4× base", measure(large, work / "out-4x", 1, args.timeout))]
        same = all((work / "out-1" / f).read_bytes() == (work / "out-2" / f).read_bytes()
                   for f in os.listdir(work / "out-1") if (work / "out-1" / f).is_file())
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(f"{'input':<20} {'MB':>8} {'seconds':>8} {'MB/s':>8} {'peak RSS MB':>12}")
    for name, r in rows:
        print(f"{name:<20} {r['source_mb']:>8.1f} {r['seconds']:>8.1f} {r['mb_per_s']:>8.2f} {r['peak_rss_mb']:>12.1f}")
    speedup = rows[1][1]["mb_per_s"] / rows[0][1]["mb_per_s"]
    memory = rows[2][1]["peak_rss_mb"] / rows[0][1]["peak_rss_mb"]
    print(f"2 workers / 1 worker: {speedup:.2f}× MB/s; output byte-identical: {same}")
    print(f"peak memory, 4× input / base input: {memory:.2f}× (bounded: well under 4×)")
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({"rows": dict(rows), "speedup_2_workers": round(speedup, 3),
                                   "memory_ratio_4x_input": round(memory, 3), "identical_1_vs_2_workers": same,
                                   "cpus": os.cpu_count(), "machine": platform.platform()}, indent=1) + "\n")


if __name__ == "__main__":
    main()
