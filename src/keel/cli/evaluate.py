"""`keel eval`: downstream tasks through lm-evaluation-harness, on a checkpoint as keel runs it or on a
Hugging Face export."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from keel.cli.pathargs import TOKENIZER, PathArg, checkpoints_at, reads, writes_file
from keel.errors import KeelError

EVAL_VALID = "pass a run directory, a checkpoints/step-NNNNNN directory or a Hugging Face export"


def add_parsers(sub: argparse._SubParsersAction) -> None:
    e = sub.add_parser("eval", help="downstream tasks (lm-evaluation-harness) on a checkpoint or a Hugging Face "
                       "export")
    e.add_argument("target", action=PathArg, check=checkpoints_at(EVAL_VALID),
                   help="a run directory (its newest checkpoint that verifies), a checkpoints/step-NNNNNN "
                   "directory, or a Hugging Face export (`keel ckpt export`)")
    e.add_argument("--tasks", required=True, help="comma-separated lm-eval tasks (e.g. hellaswag,arc_easy,piqa) or "
                   "tasks of --include")
    e.add_argument("--include", action=PathArg, append=True, default=[], metavar="DIR",
                   check=reads("dir", "pass a directory of lm-eval task YAML files", as_text=True),
                   help="a directory of lm-eval task YAML files (repeatable)")
    e.add_argument("--limit", type=int, help="at most this many examples per task")
    e.add_argument("--num-fewshot", type=int, help="examples in each prompt (default: each task's own)")
    e.add_argument("--batch-size", type=int, default=8, help="sequences per forward pass")
    e.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="where the model runs (auto: CUDA when there is a GPU)")
    e.add_argument("--tokenizer", action=PathArg, check=TOKENIZER,
                   help="the tokenizer.json (or its corpus directory) of a checkpoint "
                   "whose corpus has moved")
    e.add_argument("--out", action=PathArg, check=writes_file, help="also write the scores as JSON to this file")
    e.add_argument("--json", action="store_true", help="print the scores as JSON")
    e.set_defaults(handler=cmd_eval)


def check_eval_args(args: argparse.Namespace) -> list[str]:
    """The task names, once every number is one keel can use (the paths were checked as they were read)."""
    for flag, value, least in (("--limit", args.limit, 1), ("--num-fewshot", args.num_fewshot, 0),
                               ("--batch-size", args.batch_size, 1)):
        if value is not None and value < least:
            raise KeelError(f"{flag} {value}: expected {least} or more")
    return [t.strip() for t in args.tasks.split(",") if t.strip()]


def cmd_eval(args: argparse.Namespace) -> int:
    from keel.downstream.tasks import check_tasks, natively, run_tasks

    tasks = check_eval_args(args)
    native = natively(tasks, args.include, args.num_fewshot)
    # unknown tasks are refused before a model is loaded
    manager = None if native else check_tasks(tasks, args.include)
    # torch and the model code only now: bad input is answered without waiting for them
    from keel.downstream.models import hf_model, is_hf_export, keel_lm, keel_model
    from keel.downstream.native import run_shipped
    from keel.parallel.mesh import pick_device

    device = pick_device(args.device)
    target = Path(args.target)
    if is_hf_export(target):
        if args.tokenizer is not None:
            raise KeelError(f"--tokenizer is for keel checkpoints; {target} is a Hugging Face export with its own")
        lm, loaded = hf_model(target, device, args.batch_size)
        scores = run_tasks(lm, tasks, args.include, args.limit, args.num_fewshot, manager=manager)
    else:
        scorer, loaded = keel_model(args.target, device, args.batch_size, args.tokenizer)
        scores = (run_shipped(scorer, tasks, args.limit) if native else
                  run_tasks(keel_lm(scorer), tasks, args.include, args.limit, args.num_fewshot, manager=manager))
    report = {**loaded, "tasks": scores, "limit": args.limit, "num_fewshot": args.num_fewshot}
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report) if args.json else "\n".join(table(report)))
    return 0


def table(report: dict) -> list[str]:
    where = report.get("checkpoint") or report.get("export")
    step = f" (step {report['step']})" if "step" in report else ""
    lines = [f"{where}{step}", f"{'task':<28}{'metric':<22}{'value':>10}{'± stderr':>12}"]
    for task, metrics in sorted(report["tasks"].items()):
        for metric, value in sorted(metrics.items()):
            if metric.endswith("_stderr"):
                continue
            stderr = metrics.get(f"{metric}_stderr")
            spread = f"{stderr:>12.4f}" if isinstance(stderr, float) and stderr == stderr else f"{'':>12}"
            lines.append(f"{task:<28}{metric:<22}{value:>10.4f}{spread}")
    return lines
