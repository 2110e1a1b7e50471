"""What `keel data prepare` costs, against the floor of reading and writing the same bytes and against datatrove.

1. Near the floor, on the built-in corpus (the standard library's sources, as `make train` prepares it) and on a 4×
   larger input (that corpus and three copies with their letters rotated: other words, so other documents), byte
   tokens: the CPU time (user + system of the whole process tree: `os.wait4`, and a sampling of the tree for
   workers their parent never waits for) and wall time of a fresh
   `keel data prepare` process with 1 and 2 workers, and of bench/prepare_floor.py, a plain program that reads the
   same input files and writes as many bytes in as many files as keel's corpus holds. Repeats are interleaved, the
   order reversed every other repeat; ratios to the floor are taken within a repeat (median, min–max).
2. datatrove's equivalent pipeline (bench/prepare_datatrove.py: reader → filters → MinHash dedup → tokenizer →
   writer) on the same input, with `--datatrove-python`, an interpreter that has datatrove; skipped with a message
   without one. It is slow: one run per worker count, on the built-in corpus (and the 4× input with
   `--datatrove-large`).
3. Where the time goes: the CPU time of one in-process prepare of the built-in corpus (1 worker) split into its
   stages by timers around their functions: read, clean, hash (MinHash, exact keys, n-grams), dedup,
   decontaminate, tokenize, write, the rest; and the start-up of a fresh interpreter importing the prepare.
4. MB/s and peak memory on generated JSON-lines input (half of it gzipped, a tenth exact and a tenth near copies
   of earlier documents): 1 and 2 workers on the base input, 1 worker on 4× the base input (the memory ratio,
   target well under 4: memory grows with the number of documents' metadata, not with the bytes of text); each
   measurement is a fresh process whose peak memory is the largest sum of the resident memory of the process and
   its workers, sampled every 20 ms.

Results: tables on stdout and bench/results/prepare.json.
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
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

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


# ---------------------------------------------------------------- the floor, keel and datatrove, CPU and wall

BENCH = Path(__file__).parent


def builtin_files() -> list[Path]:
    from keel.data.sources import stdlib_files

    return stdlib_files()


def make_builtin_4x(root: Path) -> Path:
    """The built-in corpus and three copies of it, each with its letters rotated by another 7 places."""
    files = builtin_files()
    common = Path(os.path.commonpath([str(f.parent) for f in files]))
    for copy in range(4):
        for f in files:
            target = root / f"copy{copy}" / f.relative_to(common)
            target.parent.mkdir(parents=True, exist_ok=True)
            data = f.read_bytes()
            if copy:
                data = data.decode("utf-8", errors="replace").translate(SHIFTS[copy]).encode("utf-8")
            target.write_bytes(data)
    return root


SHIFTS = {k: str.maketrans({chr(base + i): chr(base + (i + 7 * k) % 26) for base in (65, 97) for i in range(26)})
          for k in (1, 2, 3)}


def timed(cmd: list[str], out: Path | None = None) -> dict:
    """CPU (user + system of the whole process tree) and wall seconds of one command; its stdout goes to `out`.
    Output goes to files, not pipes: a pipe left unread while the command fills another would stall it.

    The command's rusage (`os.wait4`) holds the CPU of the processes it waited for, exactly; a worker pool
    that never waits for its workers (datatrove's with several workers) hides theirs. So the tree is also
    sampled every 50 ms, each process's own CPU time kept, and the larger of the two sums is the figure (the
    sampling misses at most each process's last 50 ms)."""
    with tempfile.TemporaryFile() as stderr, open(out or os.devnull, "wb") as stdout:
        started = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=stdout, stderr=stderr)
        seen: dict[int, float] = {}
        done = threading.Event()

        def sample() -> None:
            root = psutil.Process(proc.pid)
            while not done.wait(0.05):
                try:
                    tree = [root, *root.children(recursive=True)]
                except psutil.Error:
                    continue
                for p in tree:
                    try:
                        times = p.cpu_times()
                        seen[p.pid] = max(seen.get(p.pid, 0.0), times.user + times.system)
                    except psutil.Error:
                        pass

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        _, status, usage = os.wait4(proc.pid, 0)  # reaps it: its rusage includes the workers it waited for
        wall = time.perf_counter() - started
        done.set()
        sampler.join()
        if status != 0:
            stderr.seek(0)
            raise SystemExit(f"{' '.join(cmd)} failed:\n{stderr.read().decode(errors='replace')[-3000:]}")
    waited = usage.ru_utime + usage.ru_stime
    return {"cpu_s": round(max(waited, sum(seen.values())), 3), "wait4_cpu_s": round(waited, 3),
            "sampled_cpu_s": round(sum(seen.values()), 3), "wall_s": round(wall, 3)}


def keel_cmd(source: str, out: Path, workers: int) -> list[str]:
    return [sys.executable, "-m", "keel", "data", "prepare", "--source", source, "--out", str(out),
            "--workers", str(workers), "data.val_fraction=0.01"]


def output_sizes(corpus: Path) -> dict[str, int]:
    return {p.relative_to(corpus).as_posix().replace("/", "_"): p.stat().st_size
            for p in sorted(corpus.rglob("*")) if p.is_file()}


def spread(values: list[float]) -> dict:
    return {"median": round(float(np.median(values)), 3), "min": round(min(values), 3),
            "max": round(max(values), 3), "each": [round(v, 3) for v in values]}


def near_floor(name: str, source: str, files: list[Path], work: Path, repeats: int, datatrove: str | None) -> dict:
    """Interleaved repeats of the floor and keel with 1 and 2 workers on one input; datatrove once per worker
    count when given."""
    listing = work / f"{name}.files"
    listing.write_text("".join(f"{f}\n" for f in files))
    first = work / f"{name}-first"
    timed(keel_cmd(source, first, 1))  # warms the page cache, and gives the output's file sizes
    sizes = work / f"{name}.sizes.json"
    sizes.write_text(json.dumps(output_sizes(first)))
    runs: dict[str, list[dict]] = {"floor": [], "keel_1": [], "keel_2": []}
    for r in range(repeats):
        order = list(runs) if r % 2 == 0 else list(reversed(runs))
        for side in order:
            out = work / f"{name}-{side}-{r}"
            if side == "floor":
                runs[side].append(timed([sys.executable, str(BENCH / "prepare_floor.py"), str(listing), str(sizes),
                                         str(out)]))
            else:
                runs[side].append(timed(keel_cmd(source, out, int(side[-1]))))
                same = output_sizes(out) == output_sizes(first) and all(
                    (out / f).read_bytes() == (first / f).read_bytes() for f in os.listdir(first)
                    if (first / f).is_file())
                if not same:
                    raise SystemExit(f"{name}: keel's output with {side[-1]} workers differs between runs")
            shutil.rmtree(out, ignore_errors=True)
    result: dict = {"input_mb": round(sum(f.stat().st_size for f in files) / 1e6, 2), "files": len(files),
                    "output_bytes": sum(json.loads(sizes.read_text()).values()), "repeats": repeats, "runs": runs}
    for w in (1, 2):
        result[f"keel_{w}_over_floor_cpu"] = spread([k["cpu_s"] / f["cpu_s"]
                                                     for k, f in zip(runs[f"keel_{w}"], runs["floor"], strict=True)])
        result[f"keel_{w}_over_floor_wall"] = spread([k["wall_s"] / f["wall_s"]
                                                      for k, f in zip(runs[f"keel_{w}"], runs["floor"], strict=True)])
    if datatrove:
        for w in (1, 2):
            out = work / f"{name}-datatrove-{w}"
            report = work / f"{name}-datatrove-{w}.json"
            run = timed([datatrove, str(BENCH / "prepare_datatrove.py"), "--files", str(listing), "--out", str(out),
                         "--workers", str(w)], out=report)
            run["output_bytes"] = json.loads(report.read_text())["output_bytes"]
            result[f"datatrove_{w}"] = run
            keel = {k: float(np.median([x[k] for x in runs[f"keel_{w}"]])) for k in ("cpu_s", "wall_s")}
            result[f"keel_{w}_over_datatrove"] = {k: round(keel[k] / run[k], 4) for k in keel}
            shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(first, ignore_errors=True)
    return result


def datatrove_python(path: str | None) -> str | None:
    """The interpreter to run datatrove with, or None (and why) when it cannot import datatrove."""
    if not path:
        print("datatrove comparison skipped: no --datatrove-python given (datatrove is not a keel dependency; "
              "install it in a separate environment and pass its python)", file=sys.stderr)
        return None
    probe = subprocess.run([path, "-c", "import datatrove, spacy, orjson, tokenizers"], capture_output=True, text=True)
    if probe.returncode != 0:
        print(f"datatrove comparison skipped: {path} cannot import datatrove and its MinHash, tokenizer and writer "
              f"dependencies (pip install datatrove spacy orjson): {probe.stderr.strip().splitlines()[-1:]}",
              file=sys.stderr)
        return None
    return path


# ---------------------------------------------------------------- where the time goes

# Each stage's functions (module, attribute; a class's method as "Class.method"): their CPU time is the stage's.
# None of them calls another's. The scan's hashing serves both dedups and the decontamination: a stage of its own.
STAGES = {
    "read": [("keel.data.prepare", "resolve_inputs"), ("keel.data.prepare", "_content_fingerprint"),
             ("keel.data.prepare", "read_documents")],
    "clean": [("keel.data.clean", "Cleaner.clean")],
    "hash (MinHash, exact keys, n-grams)": [("keel.data.prepare", "scan_hashes")],
    "dedup (exact, LSH)": [("keel.data.prepare", "_dedup")],
    "decontaminate": [("keel.data.prepare", "_contamination_set"), ("keel.data.prepare", "_TaskGrams.contaminated")],
    "tokenize": [("keel.data.tokenizer", "ByteTokenizer.encode_documents")],
    "write shards and stats": [("keel.data.prepare", "_write_corpus")],
}


def profile_stages(work: Path) -> dict:
    """CPU seconds per stage of one in-process prepare of the built-in corpus with 1 worker, from timers wrapped
    around each stage's functions (a few thousand calls: no profiler overhead to speak of); "work files and the
    rest" is what the prepare spent outside them. Start-up is a fresh interpreter importing keel's command line
    and the prepare."""
    import importlib

    from keel.config import load_config

    spent: dict[str, float] = dict.fromkeys(STAGES, 0.0)

    def timer(stage: str, function: Callable) -> Callable:
        def timed_call(*args: Any, **kwargs: Any) -> Any:
            started = time.process_time()
            try:
                result = function(*args, **kwargs)
            finally:
                spent[stage] += time.process_time() - started
            if hasattr(result, "__next__"):  # a generator: its work happens as it is iterated
                return timed_iteration(stage, result)
            return result
        return timed_call

    def timed_iteration(stage: str, iterator: Iterator) -> Iterator:
        while True:
            started = time.process_time()
            try:
                item = next(iterator)
            except StopIteration:
                spent[stage] += time.process_time() - started
                return
            spent[stage] += time.process_time() - started
            yield item

    restore = []
    for stage, functions in STAGES.items():
        for module_name, name in functions:
            owner = importlib.import_module(module_name)
            *classes, attribute = name.split(".")
            for cls in classes:
                owner = getattr(owner, cls)
            original = getattr(owner, attribute)
            restore.append((owner, attribute, original))
            setattr(owner, attribute, timer(stage, original))
    from keel.data.prepare import prepare

    data = load_config(Path(__file__).parents[1] / "configs" / "tiny.toml", ["data.workers=1"]).data
    try:
        started = time.process_time()
        prepare(data, work / "profiled")
        total = time.process_time() - started
    finally:
        for owner, attribute, original in restore:
            setattr(owner, attribute, original)
    shutil.rmtree(work / "profiled", ignore_errors=True)
    startup = timed([sys.executable, "-c", "import keel.cli, keel.data.prepare"])["cpu_s"]
    seconds = {"start-up (interpreter, imports)": startup, **spent,
               "work files and the rest": total - sum(spent.values())}
    return {"cpu_s": {k: round(v, 3) for k, v in seconds.items()},
            "shares": {k: round(v / (total + startup), 4) for k, v in seconds.items()}}


# ---------------------------------------------------------------- the whole benchmark

def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5, help="interleaved repeats of the floor and keel")
    p.add_argument("--mb", type=int, default=24, help="size of the generated base input in MB (the large one is 4×)")
    p.add_argument("--datatrove-python", help="an interpreter that imports datatrove (the comparison is skipped "
                   "without one)")
    p.add_argument("--datatrove-large", action="store_true", help="datatrove on the 4× input too (slow)")
    p.add_argument("--skip-generated", action="store_true", help="leave out the MB/s and memory rows (part 4)")
    p.add_argument("--profile-only", action="store_true", help="measure the stages alone (part 3), keeping the "
                   "other results")
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--keep", action="store_true", help="keep the generated inputs and corpora")
    args = p.parse_args()
    previous = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}
    load_before = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="keel-bench-prepare-"))
    results: dict = {}
    if args.profile_only:
        results = {**previous, "profile": profile_stages(work), "profile_load": [round(x, 2) for x in os.getloadavg()]}
        shutil.rmtree(work, ignore_errors=True)
        RESULTS.write_text(json.dumps(results, indent=1) + "\n")
        print_profile(results)
        return
    datatrove = datatrove_python(args.datatrove_python)
    try:
        large = make_builtin_4x(work / "builtin-4x")
        large_files = sorted(large.rglob("*.py"))
        results["floor"] = {
            "builtin": near_floor("builtin", "stdlib", builtin_files(), work, args.repeats, datatrove),
            "builtin_4x": near_floor("builtin_4x", str(large), large_files, work, args.repeats,
                                     datatrove if args.datatrove_large else None)}
        results["profile"] = profile_stages(work)
        if args.skip_generated:
            results.update({k: previous[k] for k in ("rows", "speedup_2_workers", "memory_ratio_4x_input",
                                                      "identical_1_vs_2_workers") if k in previous})
        else:
            results.update(generated_rows(work, args.mb, args.timeout))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    results.update({"load_before": [round(x, 2) for x in load_before],
                    "load_after": [round(x, 2) for x in os.getloadavg()],
                    "cpus": os.cpu_count(), "machine": platform.platform()})
    print_floor(results)
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")


def print_floor(results: dict) -> None:
    for name, r in results["floor"].items():
        print(f"{name}: {r['input_mb']} MB in {r['files']} files, {r['output_bytes'] / 1e6:.1f} MB out")
        for side, runs in r["runs"].items():
            cpu = np.median([x["cpu_s"] for x in runs])
            wall = np.median([x["wall_s"] for x in runs])
            ratio = r.get(f"{side}_over_floor_cpu")
            shown = f"  {ratio['median']:.2f}× the floor's CPU ({ratio['min']:.2f}–{ratio['max']:.2f})" if ratio else ""
            print(f"  {side:<12} CPU {cpu:7.2f} s  wall {wall:7.2f} s{shown}")
        for w in (1, 2):
            if f"datatrove_{w}" in r:
                d, x = r[f"datatrove_{w}"], r[f"keel_{w}_over_datatrove"]
                print(f"  datatrove_{w}  CPU {d['cpu_s']:7.2f} s  wall {d['wall_s']:7.2f} s  keel/datatrove CPU "
                      f"{x['cpu_s']:.3f}, wall {x['wall_s']:.3f}")
    print_profile(results)


def print_profile(results: dict) -> None:
    print("CPU per stage, built-in corpus, 1 worker:")
    for stage, seconds in results["profile"]["cpu_s"].items():
        print(f"  {stage:<38} {seconds:6.3f} s  {results['profile']['shares'][stage]:6.1%}")


def generated_rows(work: Path, mb: int, timeout: float) -> dict:
    base, large = make_input(work / "base", mb), make_input(work / "large", 4 * mb, seed=1)
    rows = [("1 worker, base", measure(base, work / "out-1", 1, timeout)),
            ("2 workers, base", measure(base, work / "out-2", 2, timeout)),
            ("1 worker, 4× base", measure(large, work / "out-4x", 1, timeout))]
    same = all((work / "out-1" / f).read_bytes() == (work / "out-2" / f).read_bytes()
               for f in os.listdir(work / "out-1") if (work / "out-1" / f).is_file())
    print(f"{'input':<20} {'MB':>8} {'seconds':>8} {'MB/s':>8} {'peak RSS MB':>12}")
    for name, r in rows:
        print(f"{name:<20} {r['source_mb']:>8.1f} {r['seconds']:>8.1f} {r['mb_per_s']:>8.2f} {r['peak_rss_mb']:>12.1f}")
    speedup = rows[1][1]["mb_per_s"] / rows[0][1]["mb_per_s"]
    memory = rows[2][1]["peak_rss_mb"] / rows[0][1]["peak_rss_mb"]
    print(f"2 workers / 1 worker: {speedup:.2f}× MB/s; output byte-identical: {same}")
    print(f"peak memory, 4× input / base input: {memory:.2f}× (bounded: well under 4×)")
    return {"rows": dict(rows), "speedup_2_workers": round(speedup, 3), "memory_ratio_4x_input": round(memory, 3),
            "identical_1_vs_2_workers": same}


if __name__ == "__main__":
    main()
