"""Time to recover from a worker's death: keel vs a plain torchrun restart of a minimal DCP loop.

Each repeat starts a 2-process job under torchrun's elastic agent (`--max-restarts 1`), waits for
step KILL_AFTER (a checkpoint was written at step CKPT_EVERY), SIGKILLs rank 1 from outside, and
measures the time from the kill to the first step completed after the restart, split into:

  detection   kill → the agent sees the worker failed (keel's agent: its `failure` event; torchrun's:
              the same moment, recorded by this script's hook on its monitor)
  restart     → the new workers run their first line (the agent stops the rest, re-rendezvous,
              starts them: torchrun spawns interpreters, keel forks them from its worker server)
  start       → the training code is entered (torchrun: imports; keel: its command line, the server
              having imported torch and keel once for every worker)
  rendezvous  → the process group is up (init_process_group)
  setup       → the checkpoint load starts (keel: preflight, model, data, guards)
  load        → the checkpoint is loaded
  first step  → the first step after the resume is done (warm-up)

and, apart, the work a failure loses: the steps done again (from the step restored to the step killed in) and
the time from the kill until the run is back where it was (the killed step done again).

keel: `keel train --nproc 2 --max-restarts 1` on the given config, with checkpoints on storage only, and with
the memory tier as well (`checkpoint.memory_interval`, `--memory-interval`): its restart reads the newest
memory step from the node's shared memory. The baseline: this file run as
`torchrun --standalone --nproc-per-node 2 --max-restarts 1 bench/recovery.py --worker`, the same
model (keel's Llama, FSDP2, AdamW, the config's deterministic kernels) on random tokens, `dcp.save` every
CKPT_EVERY steps and `dcp.load` of the newest at start: what a team gets from torchrun with a minimal
resuming loop.
Results: a table, and bench/results/recovery.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

STARTED = time.time()  # the baseline worker's first code (keel records keel.STARTED the same way)
RESULTS = Path(__file__).parent / "results" / "recovery.json"
REPO = Path(__file__).resolve().parents[1]
# status.json, which tells this script the step to kill at, is written every monitor.interval steps (keel's
# default is 10): every 5, so that the kill lands right after step 15.
MONITOR_INTERVAL = 5
PHASES = ("detection", "restart", "start", "rendezvous", "setup", "load", "first_step")
LOST = ("lost_steps", "back_s", "lost_work_s", "storage_bytes")  # what a failure loses, and what its restore read
SIDES = ("keel", "keel_memory", "keel_in_process", "baseline")


def spans(marks: list[float]) -> dict[str, float]:
    """The phases between consecutive time marks."""
    return {phase: end - start for phase, start, end in zip(PHASES, marks[:-1], marks[1:], strict=True)}


def run_and_kill(cmd: list[str], env: dict[str, str], step_of: Callable[[], int], pid_of: Callable[[], int],
                 step: int) -> tuple[float, str]:
    """Start the job, SIGKILL rank 1 once `step` is done, let the agent restart and finish it.
    Returns the time of the kill and the launcher's log."""
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 600
    while step_of() < step:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"{cmd[2:4]} ended (exit {proc.returncode}) or stalled before step {step}")
        time.sleep(0.02)
    killed = time.time()
    os.kill(pid_of(), signal.SIGKILL)
    _, err = proc.communicate(timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{err[-3000:]}")
    return killed, err


# ---------------------------------------------------------------- keel


def keel_once(args: argparse.Namespace, work: Path, memory_interval: int = 0, in_process: bool = False) -> dict:
    run_dir = work / "keel"
    cmd = [sys.executable, "-m", "keel", "train", "--config", args.config, "--nproc", "2", "--max-restarts", "1",
           "--run-dir", str(run_dir), f"train.steps={args.steps}", f"checkpoint.interval={args.ckpt_every}",
           f"monitor.interval={MONITOR_INTERVAL}", "eval.interval=0", f"checkpoint.memory_interval={memory_interval}",
           f"health.in_process_restart={str(in_process).lower()}", *args.overrides]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO / "src"))

    def events() -> list[dict]:
        path = run_dir / "events.jsonl"
        return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []

    def step() -> int:
        try:
            return json.loads((run_dir / "status.json").read_text())["step"]
        except (OSError, ValueError, KeyError):
            return 0

    def rank1_pid() -> int:
        return next(e["detail"]["pid"] for e in events() if e["kind"] == "start" and e["rank"] == 1)

    killed, _ = run_and_kill(cmd, env, step, rank1_pid, args.kill_after)
    rank0 = {e["detail"]["pid"] for e in events() if e["kind"] == "start" and e["rank"] == 0}
    later = [e for e in events() if e["time"] > killed]
    detected = next(e["detail"]["detected"] for e in later if e["kind"] == "failure")
    starts = [e for e in later if e["kind"] == "start"]
    resume = next(e for e in later if e["kind"] == "resume")
    first = next(e for e in later if e["kind"] == "step" and e["action"] == "first")
    load_start = resume["time"] - resume["detail"]["load_s"]
    marks = [killed, detected, min(e["detail"]["process_started"] for e in starts),
             max(e["detail"]["entered"] for e in starts), max(e["detail"]["group_ready"] for e in starts), load_start,
             resume["time"], first["time"]]
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    back = next(r["time"] for r in metrics if r.get("step") == args.kill_after and r.get("time", 0) > killed)
    step_s = statistics.median(r["time/step_s"] for r in metrics if "time/step_s" in r and r["time"] < killed)
    tier = resume["detail"].get("tier", "storage")
    read = directory_bytes(Path(resume["detail"]["checkpoint"])) if tier == "storage" else 0
    return {**spans(marks), **lost(args.kill_after - resume["step"], back - killed, step_s), "storage_bytes": read,
            "tier": tier, "survivor_kept": len(rank0) == 1}


def lost(steps: int, back_s: float, step_s: float) -> dict:
    """The work a failure lost: the steps done again, and their time on every process (2)."""
    return {"lost_steps": steps, "back_s": back_s, "lost_work_s": steps * step_s * 2}


def directory_bytes(path: Path) -> int:
    """What a restore from `path` reads: every file of it (keel checks each one's checksum)."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


# ---------------------------------------------------------------- the baseline


def baseline_once(args: argparse.Namespace, work: Path) -> dict:
    out_dir = work / "baseline"
    out_dir.mkdir()
    here = str(Path(__file__).resolve())
    cmd = [sys.executable, here, "--torchrun", str(out_dir / "marks.jsonl"), "--standalone", "--nproc-per-node", "2",
           "--max-restarts", "1", here, "--worker", "--dir", str(out_dir), "--config", args.config,
           "--steps", str(args.steps), "--ckpt-every", str(args.ckpt_every), *args.overrides]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO / "src"), TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")

    def marks() -> list[dict]:
        path = out_dir / "marks.jsonl"
        return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []

    def step() -> int:
        return max((m["step"] for m in marks() if m["what"] == "step"), default=0)

    def rank1_pid() -> int:
        return next(m["pid"] for m in marks() if m["what"] == "start" and m["rank"] == 1)

    killed, _ = run_and_kill(cmd, env, step, rank1_pid, args.kill_after)
    later = [m for m in marks() if m["time"] > killed]
    detected = next(m["time"] for m in later if m["what"] == "failed")
    starts = [m for m in later if m["what"] == "start"]
    loaded = next(m for m in later if m["what"] == "loaded" and m["rank"] == 0)
    # Rank 0 may end the step it was in after the kill: the first step after the restart follows the load.
    first = next(m for m in later if m["what"] == "step" and m["rank"] == 0 and m["time"] > loaded["time"])
    marks_ = [killed, detected, min(m["process_started"] for m in starts), max(m["entered"] for m in starts),
              max(m["group_ready"] for m in starts), loaded["load_start"], loaded["time"], first["time"]]
    back = next(m["time"] for m in later if m["what"] == "step" and m["rank"] == 0 and m["step"] == args.kill_after
                and m["time"] > loaded["time"])
    before = [m["time"] for m in marks() if m["what"] == "step" and m["rank"] == 0 and m["time"] < killed]
    step_s = statistics.median(b - a for a, b in zip(before[:-1], before[1:], strict=True))
    return {**spans(marks_), **lost(args.kill_after - loaded["step"], back - killed, step_s),
            "storage_bytes": directory_bytes(out_dir / f"step-{loaded['step']:06d}")}


def torchrun_with_a_failure_mark(marks: str, argv: list[str]) -> None:
    """Plain torchrun, with one hook for measuring only: the moment its agent first sees a failure."""
    from torch.distributed.elastic.agent.server.api import WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.run import main as torchrun

    monitor = LocalElasticAgent._monitor_workers

    def marked(self, worker_group):  # noqa: ANN001, ANN202
        result = monitor(self, worker_group)
        if result.state == WorkerState.FAILED:
            with open(marks, "a") as f:
                f.write(json.dumps({"what": "failed", "rank": -1, "time": time.time()}) + "\n")
        return result

    LocalElasticAgent._monitor_workers = marked
    torchrun(argv)


def worker(args: argparse.Namespace) -> None:
    """The minimal resuming loop: what torchrun restarts in the baseline."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard

    from keel.config import load_config
    from keel.model.llama import Llama

    entered = time.time()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    group_ready = time.time()
    out = Path(args.dir)

    def mark(what: str, **kw: float) -> None:
        with open(out / "marks.jsonl", "a") as f:
            f.write(json.dumps({"what": what, "rank": rank, "time": time.time(), **kw}) + "\n")

    mark("start", pid=os.getpid(), process_started=STARTED, entered=entered, group_ready=group_ready)
    cfg = load_config(Path(args.config), args.overrides)
    # The kernels keel's config trains with (deterministic ones by default, as bench/bare_loop.py does):
    # the two sides then differ in how they recover, not in what each step computes.
    torch.use_deterministic_algorithms(cfg.train.deterministic)
    torch.manual_seed(0)
    model = Llama(cfg.model)
    for block in model.layers.values():
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ckpts = sorted(out.glob("step-*"))
    start = 0
    if ckpts:
        load_start = time.time()
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=str(ckpts[-1]))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        start = int(ckpts[-1].name.split("-")[1])
        mark("loaded", load_start=load_start, step=start)
    seq, micro = cfg.train.seq_len, cfg.train.micro_batch
    accumulation = cfg.train.global_batch // (micro * dist.get_world_size())
    for step in range(start + 1, args.steps + 1):
        generator = torch.Generator().manual_seed(step * 1000 + rank)
        for _ in range(accumulation):
            tokens = torch.randint(0, cfg.model.vocab_size, (micro, seq + 1), generator=generator)
            logits = model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
            (loss / accumulation).backward()
        optimizer.step()
        optimizer.zero_grad()
        if step % args.ckpt_every == 0:
            model_state, optim_state = get_state_dict(model, optimizer)
            dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(out / f"step-{step:06d}"))
        mark("step", step=step)
    dist.destroy_process_group()


# ---------------------------------------------------------------- the comparison


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/tiny.toml")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--ckpt-every", type=int, default=10)
    ap.add_argument("--kill-after", type=int, default=15, help="kill rank 1 once this step is done (a multiple of "
                    f"{MONITOR_INTERVAL})")
    ap.add_argument("--memory-interval", type=int, default=5, help="the memory tier's interval, in steps, of the "
                    "third side")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--dir", help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*", help="KEY=VALUE for keel; the baseline takes its model and batch from "
                    "them too")
    if sys.argv[1:2] == ["--torchrun"]:
        torchrun_with_a_failure_mark(sys.argv[2], sys.argv[3:])
        return
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    once = {"keel": lambda work: keel_once(args, work), "baseline": lambda work: baseline_once(args, work),
            "keel_memory": lambda work: keel_once(args, work, args.memory_interval),
            "keel_in_process": lambda work: keel_once(args, work, args.memory_interval, in_process=True)}
    runs: dict[str, list[dict]] = {who: [] for who in SIDES}
    loads: dict[str, list[float]] = {who: [] for who in SIDES}  # 1-minute load average as each run started
    for repeat in range(args.repeats):
        for who in SIDES[repeat % len(SIDES):] + SIDES[:repeat % len(SIDES)]:  # each side first in turn
            loads[who].append(os.getloadavg()[0])
            with tempfile.TemporaryDirectory(prefix="keel-bench-recovery-") as tmp:
                got = once[who](Path(tmp))
            runs[who].append(got)
            print(f"  repeat {repeat} {who}: " + ", ".join(f"{k} {got[k]:.2f} s" for k in PHASES)
                  + f", total {total(got):.2f} s, {got['lost_steps']} step(s) lost, back at step {args.kill_after} "
                  f"{got['back_s']:.2f} s after the kill, load {loads[who][-1]:.1f}", flush=True)
    median = {who: {p: statistics.median(r[p] for r in rs) for p in (*PHASES, *LOST)} for who, rs in runs.items()}
    for m in median.values():
        m["total"] = sum(m[p] for p in PHASES)
    # Each repeat's keel total over the plain restart's of the same repeat.
    pairs = [total(k) / total(b) for k, b in zip(runs["keel"], runs["baseline"], strict=True)]
    back = [m["back_s"] / s["back_s"] for m, s in zip(runs["keel_memory"], runs["keel"], strict=True)]
    # The in-process restart's total over keel's restart of every worker (both from the memory tier), and over
    # the plain restart, each of the same repeat.
    in_process = {against: per_repeat([total(a) / total(b) for a, b in zip(runs["keel_in_process"], runs[against],
                                                                            strict=True)])
                  for against in ("keel_memory", "baseline")}
    print("\n| phase | keel, s | keel with the memory tier, s | the same, in-process restart, s | torchrun + minimal "
          "DCP loop, s |\n|---|---|---|---|---|")
    for p in (*PHASES, "total", *LOST):
        print(f"| {p.replace('_', ' ')} | " + " | ".join(f"{median[who][p]:.6g}" for who in SIDES) + " |")
    print(f"\nratio keel / baseline (total, median of {args.repeats}): "
          f"{median['keel']['total'] / median['baseline']['total']:.2f}; per repeat {statistics.median(pairs):.2f} "
          f"({min(pairs):.2f}–{max(pairs):.2f}); back where it was, memory tier / storage only: "
          f"{statistics.median(back):.2f} ({min(back):.2f}–{max(back):.2f}); in-process / restart of every worker "
          f"{in_process['keel_memory']['median']:.2f}, / plain restart {in_process['baseline']['median']:.2f}; load "
          f"{min(min(v) for v in loads.values()):.1f}–{max(max(v) for v in loads.values()):.1f}")
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({
        "benchmark": "recovery", "config": args.config, "overrides": args.overrides, "steps": args.steps,
        "ckpt_every": args.ckpt_every, "kill_after": args.kill_after, "memory_interval": args.memory_interval,
        "repeats": args.repeats, "median": median, "ratio_total": median["keel"]["total"] / median["baseline"]["total"],
        "ratio_total_per_repeat": per_repeat(pairs), "ratio_back_memory_per_repeat": per_repeat(back),
        "ratio_in_process_per_repeat": in_process,
        "runs": runs, "load": loads, "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()}}, indent=1) + "\n")


def total(run: dict) -> float:
    return sum(run[p] for p in PHASES)


def per_repeat(ratios: list[float]) -> dict:
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios), "each": ratios}


if __name__ == "__main__":
    main()
