"""What one failure costs: replica groups that keep training (non-stop) against keel's restart of the whole job.

Each repeat runs the same job twice, in alternating order, and SIGKILLs it in the middle of step KILL_AT
through the drill injector (`kill`, after the backward, the real signal to the process itself):

  non-stop          `keel train --replica-groups 2 --nproc P`, every process of group 1 killed
                    (`kill:step=S,rank=-1,group=1`); its agent restarts it and it heals from group 0, which
                    trains on meanwhile; `fault_tolerance.heartbeat_timeout_s = 1`.
  restart-everything `keel train --nproc 2P --max-restarts 1`, rank 1 killed (`kill:step=S,rank=1`); the
                    agent restarts every worker and they resume from the newest checkpoint.

Both jobs hold the same number of processes (accelerators), the same global batch and the same
checkpoint interval, so each step is the same work on the same hardware and only the recovery differs.
The kill lands half an interval after the newest checkpoint, the expected position of a failure that
may come at any step.

From the runs' own step records (rank 0's `metrics.jsonl`, one record per step with `monitor.interval
= 1`: the survivor group's RUN_DIR/groups/0 for non-stop, RUN_DIR for restart-everything) and events:

  pace       the fault-free step time: the median interval between the steps done before the kill,
             after the first WARMUP_STEPS, leaving out the checkpoint steps; `save` is what a checkpoint
             step took beyond it there. A checkpoint step after the kill counts `save` less below: it
             is as slow without a failure.
  longest    the longest interval between consecutive step records from the last step done before the
             kill to the end of the window (below): the survivors' slowest step for non-stop, the whole
             outage for restart-everything, whose workers all stop.
  healed     the time from the kill to the end of the first step the restarted processes take part in
             (non-stop: group 1's first step after its `quorum`/`heal` event; restart-everything: the
             first step after the restart). `heal event` is the kill → that quorum event.
  lost       accelerator-seconds not spent on committed training: with N processes in the job, t0 and
             s0 the time and step of the last step done before the kill, t1 and s1 those of the
             SETTLE_STEPS-th step after `healed`'s step (so that slow first steps are counted), and C
             the checkpoint steps in that window,
                 lost = N × ((t1 − t0) − C × save − (s1 − s0) × pace),
             the process-seconds the window held minus what its net progress costs at the fault-free
             pace. It holds the dead processes' downtime and restart, the survivors' stall and, for
             restart-everything, the steps made again from the checkpoint (s1 − s0 counts only the net
             progress, negative while the restarted job is behind). While a group is missing its
             survivors read its share of every global batch, so their steps take longer and the missing
             processes' seconds are counted as lost, as they are.
  lost by parts  the same from its parts (`lost_by_parts`): on CPU the processes share cores, and a
             survivor runs faster on the core a dead process freed, which `lost` sees as less lost; on
             accelerators, each process its own, it does not.

The ratios (non-stop / restart-everything) are taken within each pair of interleaved repeats and
reported as their median and range. Results: a table, and bench/results/nonstop_recovery.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from itertools import pairwise
from pathlib import Path

from keel.rundir.events import read_jsonl

RESULTS = Path(__file__).parent / "results" / "nonstop_recovery.json"
REPO = Path(__file__).resolve().parents[1]
WARMUP_STEPS = 3
SETTLE_STEPS = 3
HEARTBEAT_TIMEOUT_S = 1.0
# The tiny config's model at a quarter of its width and batch: a step of a few tenths of a second on the
# 2 loaded cores, so that a repeat takes about a minute and the steps, not the machine's noise, are measured.
SMALL_SHAPE = ["model.dim=128", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.max_seq_len=128",
               "train.seq_len=128", "train.global_batch=16", "train.micro_batch=4", "health.preflight_probe_mib=4"]
MODES = ("nonstop", "restart")


# ---------------------------------------------------------------- the accounting


def step_records(metrics: list[dict]) -> list[tuple[int, float]]:
    """(step, time) of each training step in the order written; a step made again after a restart appears
    again (the validation records, which carry no time, are left out)."""
    return [(r["step"], r["time"]) for r in metrics if "time" in r and "train/loss" in r]


def durations(steps: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """(step, seconds since the record before) of each record but the first."""
    return [(step, t - t_before) for (_, t_before), (step, t) in pairwise(steps)]


def account(steps: list[tuple[int, float]], killed: float, healed: float, nproc: int,
            ckpt_every: int) -> dict[str, float]:
    """The cost of the failure at `killed` from the job's step records, the job whole again at `healed`
    (the module's docstring defines each figure)."""
    first = sum(t < killed for _, t in steps) - 1
    before = durations(steps[:first + 1])[WARMUP_STEPS:]
    plain = [d for step, d in before if step % ckpt_every]
    if len(plain) < 2:
        raise SystemExit(f"only {first + 1} steps before the kill: kill later than step {WARMUP_STEPS + 3}")
    pace = statistics.median(plain)
    saves = [d for step, d in before if not step % ckpt_every]
    save = statistics.median(saves) - pace if saves else 0.0
    after = next((i for i, (_, t) in enumerate(steps) if t >= healed), len(steps))
    last = after + SETTLE_STEPS
    if last >= len(steps):
        raise SystemExit(f"the run ended within {SETTLE_STEPS} steps of its recovery: give it more steps")
    (s0, t0), (s1, t1) = steps[first], steps[last]
    # What each interval of the window took beyond a fault-free one's save, where it holds a checkpoint.
    window = [d - (0.0 if step % ckpt_every else save) for step, d in durations(steps[first:last + 1])]
    longest = max(window)
    return {"pace_s": pace, "save_s": save, "longest_step_s": longest, "longest_over_pace_s": longest - pace,
            "healed_s": healed - killed, "window_s": t1 - t0, "progress_steps": s1 - s0,
            "lost_accelerator_s": nproc * (sum(window) - (s1 - s0) * pace)}


def lost_by_parts(run: dict[str, float], mode: str, nproc: int, kill_at: int, ckpt_every: int) -> float:
    """`lost` from its parts, for accelerators that a core shared with a dead process does not speed up: the
    processes that died or were stopped × kill → healed, the survivors × (longest − pace), and every process
    × the steps made again from the checkpoint × pace."""
    if mode == "nonstop":
        return nproc * (run["healed_s"] + run["longest_over_pace_s"])
    made_again = kill_at - 1 - (kill_at - 1) // ckpt_every * ckpt_every
    return 2 * nproc * (run["healed_s"] + made_again * run["pace_s"])


def kill_time(events: list[dict]) -> float:
    return next(e["time"] for e in events if e["kind"] == "drill" and e["action"] == "inject")


def first_after(steps: list[tuple[int, float]], when: float) -> float:
    return next(t for _, t in steps if t > when)


# ---------------------------------------------------------------- the two jobs


def keel_train(args: argparse.Namespace, run_dir: Path, layout: list[str], fault: str) -> None:
    cmd = [sys.executable, "-m", "keel", "train", "--config", args.config, *layout, "--run-dir", str(run_dir),
           f"train.steps={args.steps}", f"checkpoint.interval={args.ckpt_every}", "eval.interval=0",
           "monitor.interval=1", f"fault_tolerance.heartbeat_timeout_s={HEARTBEAT_TIMEOUT_S}",
           f'drill.inject=["{fault}"]', *args.overrides]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO / "src"))
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-3000:]}")


def nonstop_once(args: argparse.Namespace, work: Path, nproc: int) -> dict[str, float]:
    run_dir = work / "nonstop"
    keel_train(args, run_dir, ["--replica-groups", "2", "--nproc", str(nproc), "--max-restarts", "1"],
               f"kill:step={args.kill_at},rank=-1,group=1")
    survivor = step_records(read_jsonl(run_dir / "groups" / "0" / "metrics.jsonl"))
    restarted = read_jsonl(run_dir / "groups" / "1" / "events.jsonl")
    killed = kill_time(restarted)
    heal = next((e["time"] for e in restarted
                 if e["kind"] == "quorum" and e["action"] == "heal" and e["time"] > killed), None)
    if heal is None:
        raise SystemExit(f"group 1 did not heal before step {args.steps}: give the run more steps")
    healed = first_after(step_records(read_jsonl(run_dir / "groups" / "1" / "metrics.jsonl")), heal)
    return {**account(survivor, killed, healed, 2 * nproc, args.ckpt_every), "heal_event_s": heal - killed}


def restart_once(args: argparse.Namespace, work: Path, nproc: int) -> dict[str, float]:
    run_dir = work / "restart"
    keel_train(args, run_dir, ["--nproc", str(2 * nproc), "--max-restarts", "1"], f"kill:step={args.kill_at},rank=1")
    steps = step_records(read_jsonl(run_dir / "metrics.jsonl"))
    events = read_jsonl(run_dir / "events.jsonl")
    killed = kill_time(events)
    resumed = next(e["time"] for e in events if e["kind"] == "resume" and e["time"] > killed)
    return {**account(steps, killed, first_after(steps, killed), 2 * nproc,
                       args.ckpt_every), "resume_event_s": resumed - killed}


# ---------------------------------------------------------------- the comparison


def compare(args: argparse.Namespace, nproc: int) -> dict:
    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    for repeat in range(args.repeats):
        for mode in MODES if repeat % 2 == 0 else MODES[::-1]:
            with tempfile.TemporaryDirectory(prefix="keel-bench-nonstop-") as tmp:
                started = time.monotonic()
                got = (nonstop_once if mode == "nonstop" else restart_once)(args, Path(tmp), nproc)
            got["lost_by_parts_accelerator_s"] = lost_by_parts(got, mode, nproc, args.kill_at, args.ckpt_every)
            runs[mode].append(got)
            print(f"  2 × {nproc}, repeat {repeat} {mode} ({time.monotonic() - started:.0f} s): "
                  + ", ".join(f"{k} {v:.2f}" for k, v in got.items()), flush=True)
    median = {mode: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for mode, rs in runs.items()}
    ratios = [n["lost_accelerator_s"] / r["lost_accelerator_s"] for n, r in zip(runs["nonstop"], runs["restart"],
                                                                              strict=True)]
    by_parts = [n["lost_by_parts_accelerator_s"] / r["lost_by_parts_accelerator_s"]
                for n, r in zip(runs["nonstop"], runs["restart"], strict=True)]
    return {"nproc_per_group": nproc, "processes": 2 * nproc, "median": median, "lost_ratios": ratios,
            "lost_ratio": statistics.median(ratios), "lost_by_parts_ratios": by_parts,
            "lost_by_parts_ratio": statistics.median(by_parts), "runs": runs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/tiny.toml")
    ap.add_argument("--nproc", type=int, nargs="+", default=[1, 2], help="processes per replica group (each a row)")
    ap.add_argument("--steps", type=int, default=420)
    ap.add_argument("--ckpt-every", type=int, default=200)
    ap.add_argument("--kill-at", type=int, default=0, help="the step the kill lands in (default: half an "
                    "interval after the first checkpoint)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("overrides", nargs="*", default=SMALL_SHAPE, help="KEY=VALUE for both jobs (default: the "
                    "tiny model at a quarter of its width and batch)")
    args = ap.parse_args()
    args.kill_at = args.kill_at or args.ckpt_every + args.ckpt_every // 2
    rows = []
    for nproc in args.nproc:  # the results are written after each row, so that a later row's failure keeps them
        rows.append(compare(args, nproc))
        RESULTS.parent.mkdir(exist_ok=True)
        RESULTS.write_text(json.dumps({
            "benchmark": "nonstop_recovery", "config": args.config, "overrides": args.overrides, "steps": args.steps,
            "ckpt_every": args.ckpt_every, "kill_at": args.kill_at, "repeats": args.repeats,
            "heartbeat_timeout_s": HEARTBEAT_TIMEOUT_S, "warmup_steps": WARMUP_STEPS, "settle_steps": SETTLE_STEPS,
            "rows": rows, "machine": {"cpus": os.cpu_count(), "platform": platform.platform()}}, indent=1) + "\n")
    print("\n| job | lost accelerator-s, non-stop | restart-everything | ratio (range) | survivors' longest step "
          "− pace, s | kill → healed step, s |\n|---|---|---|---|---|---|")
    for row in rows:
        n, r = row["median"]["nonstop"], row["median"]["restart"]
        print(f"| 2 × {row['nproc_per_group']} | {n['lost_accelerator_s']:.1f} | {r['lost_accelerator_s']:.1f} | "
              f"{row['lost_ratio']:.3f} ({min(row['lost_ratios']):.3f}–{max(row['lost_ratios']):.3f}) | "
              f"{n['longest_over_pace_s']:.2f} | {n['healed_s']:.2f} vs {r['healed_s']:.2f} |")

if __name__ == "__main__":
    main()
