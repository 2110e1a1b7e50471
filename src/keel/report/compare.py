"""Runs side by side. `keel report RUN_A RUN_B ...`: one page overlaying the runs' curves (loss, validation
loss, learning rate, gradient norm, throughput, goodput) with the config keys whose values differ; `keel runs
[DIR]`: every run directory under DIR, one line each (state, step, losses, goodput)."""

from __future__ import annotations

import os
import time
from html import escape
from pathlib import Path

from keel.errors import KeelError
from keel.report.html import CSS, LAYER_COLORS, STATE_COLOR, nodata, panel, trajectory
from keel.report.status import RUN_FILES, Run, is_run_dir, load_run, summary
from keel.report.svg import Series, line_chart

CURVES = (("Training loss", "train/loss", "nats/token"), ("Validation loss", "val/loss", "nats/token"),
          ("Learning rate", "optim/lr", ""), ("Gradient norm", "optim/grad_norm", ""),
          ("Throughput", "throughput/tokens_per_s", "tokens/s"), ("Goodput", "goodput/ratio", "%"))


def flatten(table: dict, prefix: str = "") -> dict[str, object]:
    """A config's values by dotted key (named tables such as data.sources.main included)."""
    out: dict[str, object] = {}
    for key, value in table.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out |= flatten(value, name + ".")
        else:
            out[name] = value
    return out


def config_differences(runs: list[Run]) -> list[tuple[str, list[object]]]:
    """The keys whose value is not the same in every run's config.toml (a missing key reads as None)."""
    flat = [flatten(run.config) for run in runs]
    keys = sorted(set().union(*flat))
    table = [(k, [f.get(k) for f in flat]) for k in keys]
    return [(k, values) for k, values in table if len({repr(v) for v in values}) > 1]


def label(run: Run, runs: list[Run]) -> str:
    """The shortest name that tells the runs apart: the directory name, else its path."""
    names = [r.path.name for r in runs]
    return run.path.name if names.count(run.path.name) == 1 else str(run.path)


def _overlay(runs: list[Run], key: str, factor: float = 1.0) -> list[Series]:
    out = []
    for i, run in enumerate(runs):
        kept, _ = trajectory(run.metrics, key)
        if kept:
            out.append(Series(label(run, runs), [r["step"] for r in kept],
                              [r[key] * factor if isinstance(r[key], (int, float)) else None for r in kept],
                              LAYER_COLORS[i % len(LAYER_COLORS)], dots=key == "val/loss"))
    return out


def _summary_table(runs: list[Run]) -> str:
    rows = []
    for i, run in enumerate(runs):
        info = summary(run.path, events=0)
        state, color = info["state"], LAYER_COLORS[i % len(LAYER_COLORS)]
        loss = {k: f"{info[k]['value']:.4f}" if info[k] else "-" for k in ("train_loss", "val_loss")}
        ratio = f"{info['goodput_ratio']:.1%}" if info["goodput_ratio"] is not None else "-"
        total = f"/{info['total_steps']}" if info.get("total_steps") else ""
        rows.append(f"<tr><td><i class='swatch' style='background:{color}'></i>{escape(label(run, runs))}</td>"
                    f"<td><span class='badge' style='background:{STATE_COLOR.get(state, '#64748b')}'>"
                    f"{escape(state)}</span></td><td class='num'>{info['step']}{total}</td>"
                    f"<td class='num'>{loss['train_loss']}</td><td class='num'>{loss['val_loss']}</td>"
                    f"<td class='num'>{ratio}</td><td>{escape(str(run.path))}</td></tr>")
    return ("<table><tr><th>run</th><th>state</th><th>step</th><th>train loss</th><th>validation loss</th>"
            f"<th>goodput</th><th>directory</th></tr>{''.join(rows)}</table>")


def _differences_table(runs: list[Run]) -> str:
    diffs = config_differences(runs)
    if not diffs:
        return "<p class='sub'>The runs' configs are the same.</p>"
    head = "".join(f"<th>{escape(label(r, runs))}</th>" for r in runs)
    rows = "".join(f"<tr><td>{escape(k)}</td>" + "".join(f"<td>{escape('-' if v is None else str(v))}</td>"
                                                          for v in values) + "</tr>" for k, values in diffs)
    return f"<table><tr><th>config key</th>{head}</tr>{rows}</table>"


def render_comparison(runs: list[Run]) -> str:
    panels = []
    for title, key, unit in CURVES:
        series = _overlay(runs, key, 100.0 if unit == "%" else 1.0)
        body = line_chart(series, width=600, height=200, label=title) if series else nodata(f"no {key} records")
        panels.append(panel(title, body, unit, [(s.name, s.color) for s in series]))
    names = ", ".join(label(r, runs) for r in runs)
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{escape(names)} · keel run '
            f'comparison</title><style>{CSS} i.swatch {{ display:inline-block; width:10px; height:10px; '
            f'margin-right:6px }}</style></head><body><main><h1>{len(runs)} runs compared</h1>'
            f'<p class="sub">written {time.strftime("%Y-%m-%d %H:%M:%S")}</p>{_summary_table(runs)}'
            f'<h2>Config differences</h2>{_differences_table(runs)}<h2>Curves</h2>'
            f'<div class="grid">{"".join(panels)}</div></main></body></html>\n')


def write_comparison(run_dirs: list[Path], out: Path) -> Path:
    for d in run_dirs:
        if not is_run_dir(d):
            raise KeelError(f"{str(d)!r} is not a keel run directory: expected the --run-dir of a keel train job, "
                            f"holding {', '.join(RUN_FILES)}")
    if len({d.resolve() for d in run_dirs}) < len(run_dirs):
        raise KeelError("a run directory is given twice; compare distinct runs")
    page = render_comparison([load_run(d) for d in run_dirs])
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(page)
    os.replace(tmp, out)
    return out


def find_runs(root: Path) -> list[Path]:
    """The run directories at or under `root`, outermost first: a run of replica groups is one run (its
    groups/G directories are not listed apart), and a checkpoint directory is never a run."""
    if not root.is_dir():
        raise KeelError(f"{str(root)!r} is not a directory; pass a directory holding run directories "
                        f"(default ./runs)")
    found: list[Path] = []
    for here, dirs, _ in os.walk(root):
        path = Path(here)
        if is_run_dir(path):
            found.append(path)
            dirs[:] = [d for d in dirs if d not in ("groups", "checkpoints", "logs")]
        dirs.sort()
    return found


def list_runs(root: Path) -> list[dict]:
    rows = []
    for path in find_runs(root):
        info = summary(path, events=0)
        rows.append({"run_dir": str(path), "name": info["name"], "state": info["state"], "step": info["step"],
                     "total_steps": info.get("total_steps"),
                     "train_loss": info["train_loss"]["value"] if info["train_loss"] else None,
                     "val_loss": info["val_loss"]["value"] if info["val_loss"] else None,
                     "goodput": info["goodput_ratio"], "updated": info["since"]})
    return rows


def runs_lines(rows: list[dict], root: Path) -> list[str]:
    if not rows:
        return [f"no keel run directories under {root}"]
    out = [f"{'run':<40}{'state':>10}{'step':>14}{'train loss':>12}{'val loss':>10}{'goodput':>9}  updated"]
    for r in rows:
        where = os.path.relpath(r["run_dir"], root)
        step = f"{r['step']}/{r['total_steps']}" if r["total_steps"] else str(r["step"])
        losses = [f"{v:.4f}" if v is not None else "-" for v in (r["train_loss"], r["val_loss"])]
        goodput = f"{r['goodput']:.1%}" if r["goodput"] is not None else "-"
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(r["updated"])) if r["updated"] else "-"
        out.append(f"{where:<40}{r['state']:>10}{step:>14}{losses[0]:>12}{losses[1]:>10}{goodput:>9}  {when}")
    return out
