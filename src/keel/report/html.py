"""`keel report RUN_DIR`: one self-contained HTML page (inline CSS and SVG; nothing is fetched, it opens
offline) with the run's curves, the event timeline on the loss curve's step axis, the step-time and
goodput breakdowns, a mixture-of-experts model's routing, the hardware telemetry and the table of events. A
run of replica groups gets the run as a whole, its groups' quorum (live groups over time, heals and retries,
each group's goodput), the furthest group's curves and every group's events."""

from __future__ import annotations

import json
import math
import os
import re
import time
from dataclasses import replace
from html import escape
from pathlib import Path

from keel.errors import KeelError
from keel.report.drill import DRILL_FILE, drill_section, load_drill
from keel.report.status import (
    RUN_FILES,
    Run,
    by_time,
    goodput_ratio,
    group_dirs,
    is_run_dir,
    load_run,
    quorum_events,
    replica_summary,
    summarize,
    tagged,
)
from keel.report.svg import (
    Marker,
    Series,
    bar_chart,
    diverging,
    domain,
    finite,
    fmt_duration,
    fmt_num,
    heat_map,
    line_chart,
    stacked_chart,
    stepwise,
)

BLUE, ORANGE, GREEN, PURPLE, RED, CYAN, AMBER, SLATE = ("#2563eb", "#ea580c", "#16a34a", "#9333ea", "#dc2626",
                                                        "#0891b2", "#d97706", "#64748b")
BUCKETS = {"productive": GREEN, "startup": BLUE, "checkpoint_blocking": PURPLE, "checkpoint_restore": "#c084fc",
           "wasted": RED, "data_wait": CYAN, "guard_checks": AMBER, "evaluation": "#0d9488", "paused": "#94a3b8",
           "failed_down": "#7f1d1d", "replica_quorum": "#0e7490", "replica_cover": "#67e8f9"}
STEP_TIME = (("time/data_s", "data", CYAN), ("time/forward_backward_s", "forward/backward", BLUE),
             ("time/optimizer_s", "optimizer", PURPLE), ("time/guard_s", "guard", AMBER),
             ("time/checkpoint_s", "checkpoint", GREEN))
LANE_OF = {"start": "run", "resume": "run", "finish": "run", "pause": "run", "preflight": "run",
           "checkpoint": "checkpoint", "guard": "guard", "straggler": "health", "leave": "health",
           "quarantine": "health", "telemetry": "health", "alert": "alert", "failure": "failure", "hang": "failure"}
LANES = ("run", "checkpoint", "guard", "health", "alert", "failure", "other")
ROUTINE = {("step", "first"), ("checkpoint", "interval"), ("checkpoint", "retired"), ("preflight", "passed")}
# Telemetry readings drawn, in this order: name -> (title, factor, unit).
TELEMETRY = {"host_cpu_utilization_ratio": ("host CPU", 100, "%"),
             "host_memory_used_bytes": ("host memory used", 2 ** -30, "GiB"),
             "gpu_utilization_ratio": ("GPU utilisation", 100, "%"),
             "gpu_temperature_celsius": ("GPU temperature", 1, "°C"), "gpu_power_watts": ("GPU power", 1, "W"),
             "gpu_memory_used_bytes": ("GPU memory used", 2 ** -30, "GiB"),
             "gpu_sm_clock_hertz": ("GPU SM clock", 1e-9, "GHz"),
             "storage_free_bytes": ("storage free", 2 ** -30, "GiB"),
             "storage_write_latency_seconds": ("storage write latency", 1e3, "ms"),
             "network_errors_total": ("network errors", 1, "since start"),
             "network_drops_total": ("network drops", 1, "since start"),
             "gpu_ecc_errors_total": ("GPU ECC errors", 1, "since start"),
             "gpu_xid_errors_total": ("GPU XID errors", 1, "since start")}
MAX_PANELS = 64  # hardware small multiples; a large job lists the rest
MAX_ROWS = 400  # event table rows (the newest)

CSS = """
* { box-sizing: border-box }
body { margin: 0; background: #f6f7f9; color: #111827; font: 14px/1.45 system-ui, -apple-system, "Segoe UI",
  Roboto, Helvetica, Arial, sans-serif }
main { max-width: 1280px; margin: 0 auto; padding: 20px 24px 40px }
h1 { font-size: 22px; margin: 0 } h2 { font-size: 16px; margin: 26px 0 10px; color: #374151 }
h3 { font-size: 13px; margin: 0 0 4px; font-weight: 600; color: #374151 }
.sub { color: #6b7280; font-size: 12px; margin: 4px 0 14px; word-break: break-all }
.badge { display: inline-block; padding: 2px 10px; border-radius: 999px; font-size: 12px; font-weight: 600;
  color: #fff; vertical-align: middle; margin-left: 10px }
.cards { display: grid; grid-template-columns: repeat(auto-fill, minmax(150px, 1fr)); gap: 10px }
.card, .panel { background: #fff; border: 1px solid #e5e7eb; border-radius: 8px; padding: 8px 12px; min-width: 0 }
.card b { display: block; font-size: 18px; font-weight: 600; white-space: nowrap; overflow: hidden;
  text-overflow: ellipsis }
.card span { font-size: 11px; color: #6b7280; text-transform: uppercase; letter-spacing: .04em }
.progress { height: 4px; background: #e5e7eb; border-radius: 2px; margin-top: 4px }
.progress div { height: 4px; border-radius: 2px; background: #2563eb }
.grid { display: grid; grid-template-columns: 1fr 1fr; gap: 12px }
.small { display: grid; grid-template-columns: repeat(4, 1fr); gap: 10px }
.panel svg { width: 100%; height: auto; display: block }
.unit { color: #9ca3af; font-weight: 400 }
.legend { font-size: 12px; color: #4b5563; margin: 0 0 4px }
.legend i { display: inline-block; width: 14px; height: 3px; margin: 0 5px 3px 10px; vertical-align: middle }
.legend i:first-child { margin-left: 0 }
.nodata { color: #9ca3af; font-style: italic; margin: 6px 0 } .note { color: #6b7280; font-size: 12px; margin: 6px 0 0 }
table { width: 100%; border-collapse: collapse; background: #fff; font-size: 12px; border: 1px solid #e5e7eb }
th, td { text-align: left; padding: 4px 8px; border-bottom: 1px solid #f1f5f9; vertical-align: top }
th { background: #f9fafb; color: #374151 } td:first-child { white-space: nowrap }
td.num { text-align: right; font-variant-numeric: tabular-nums }
tr.bad td { background: #fef2f2 } tr.warn td { background: #fffbeb }
"""
STATE_COLOR = {"running": BLUE, "finished": GREEN, "paused": SLATE, "stopped": AMBER, "failed": RED}


def write_report(run_dir: Path, out: Path | None = None) -> Path:
    """Write the report (RUN_DIR/report.html unless `out` says otherwise) and return its path."""
    if not is_run_dir(run_dir) and not (run_dir / DRILL_FILE).exists():
        raise KeelError(f"{str(run_dir)!r} is not a keel run directory: expected the --run-dir of a keel train "
                        f"job, holding {', '.join(RUN_FILES)}, or a keel drill --workdir holding {DRILL_FILE}")
    page = render(load_run(run_dir), load_drill(run_dir))
    out = out or run_dir / "report.html"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(page)
    os.replace(tmp, out)
    return out


def trajectory(records: list[dict], key: str) -> tuple[list[dict], list[dict]]:
    """The records holding `key` that the run kept, and those it abandoned: a rollback or a restart
    from a checkpoint redoes steps, so a record is abandoned once a later record is for an earlier step
    or a later record of the same key is for the same step."""
    kept: list[dict] = []
    dropped: list[dict] = []
    later = later_same = float("inf")
    for record in reversed(records):
        step = record.get("step")
        if not isinstance(step, int):
            continue
        if key in record:
            (dropped if step > later or step >= later_same else kept).append(record)
            later_same = min(later_same, step)
        later = min(later, step)
    return kept[::-1], dropped[::-1]


def _series(records: list[dict], key: str, name: str, color: str, factor: float = 1.0, **style) -> Series:
    ys = [r[key] * factor if finite(r[key]) else None for r in records]
    return Series(name, [r["step"] for r in records], ys, color, **style)


def _legend(items: list[tuple[str, str]]) -> str:
    return '<div class="legend">' + "".join(f'<i style="background:{c}"></i>{escape(n)}' for n, c in items) + "</div>"


def panel(title: str, body: str, unit: str = "", legend: list[tuple[str, str]] | None = None, note: str = "") -> str:
    head = f'<h3>{escape(title)}{f" <span class=unit>({escape(unit)})</span>" if unit else ""}</h3>'
    return (f'<div class="panel">{head}{_legend(legend) if legend else ""}{body}'
            f'{f"<p class=note>{escape(note)}</p>" if note else ""}</div>')


def nodata(why: str = "") -> str:
    return f'<p class="nodata">no data{f": {escape(why)}" if why else ""}</p>'


def _when(t: object, fmt: str = "%Y-%m-%d %H:%M:%S") -> str:
    return time.strftime(fmt, time.localtime(t)) if finite(t) else "-"


def short_detail(detail: object, limit: int = 140) -> str:
    if not isinstance(detail, dict):
        return str(detail)[:limit]
    first = [k for k in ("message", "reason", "guard", "rule") if k in detail]
    parts = []
    for k in first + [k for k in detail if k not in first]:
        v = detail[k]
        text = f"{v:.4g}" if isinstance(v, float) else json.dumps(v)[:60] if isinstance(v, dict | list) else str(v)
        parts.append(f"{k}={text}")
    text = ", ".join(parts)
    return text if len(text) <= limit else text[:limit - 1] + "…"


def severity(e: dict) -> str:
    kind, action = e.get("kind"), e.get("action")
    level = (e.get("detail") or {}).get("severity") if isinstance(e.get("detail"), dict) else None
    if kind in ("failure", "hang") or action in ("stop", "failed", "quarantine") or level in ("error", "critical"):
        return "bad"
    if kind in ("alert", "straggler", "leave", "pause", "guard") or level == "warning":
        return "warn"
    return ""


def event_color(e: dict) -> str:
    level = severity(e)
    if level:
        return RED if level == "bad" else AMBER
    return GREEN if e.get("kind") in ("checkpoint", "finish") else BLUE if e.get("kind") in ("start", "resume") \
        else SLATE


def event_markers(events: list[dict]) -> tuple[list[str], list[Marker]]:
    """Lanes in use and their markers. Every rank writes its start at step 0, before the checkpoint is
    loaded: the marker goes to the step that start resumed from (its resume event), where it happened."""
    shown, resumed_at = [], 0
    for e in reversed(events):
        if not isinstance(e.get("step"), int):
            continue
        if e.get("kind") == "resume":
            resumed_at = e["step"]
        elif e.get("kind") in ("step", "finish", "failure"):  # the start before these did not resume
            resumed_at = 0
        if (e.get("kind"), e.get("action")) not in ROUTINE and e["kind"] != "step":
            shown.append((resumed_at if e["kind"] == "start" else e["step"], e))
    used = [lane for lane in LANES if any(LANE_OF.get(e["kind"], "other") == lane for _, e in shown)]
    markers = [Marker(step, used.index(LANE_OF.get(e["kind"], "other")), event_color(e),
                      f"step {step} · {e['kind']} {e.get('action', '')} · rank {e.get('rank', '-')} · "
                      f"{_when(e.get('time'), '%H:%M:%S')}\n{short_detail(e.get('detail'), 300)}",
                      3.0 if e["kind"] == "checkpoint" else 4.2) for step, e in reversed(shown)]
    return used, markers


def training(run: Run) -> str:
    train, abandoned = trajectory(run.metrics, "train/loss")
    val, _ = trajectory(run.metrics, "val/loss")
    lanes, markers = event_markers(run.events)
    main = [s for s in (_series(train, "train/loss", "train", BLUE),
                        _series(val, "val/loss", "validation", ORANGE, dots=True)) if s.xs]
    faded = [_series(abandoned, "train/loss", "abandoned (redone after a rollback or restart)", "#9ca3af",
                     dash="3 3")] if abandoned else []
    series = faded + main  # the abandoned steps under the kept ones
    legend = [(s.name, s.color) for s in main + faded]
    if series or markers:
        body = line_chart(series, width=1220, height=260, lanes=lanes, markers=markers, label="loss and events")
        loss = panel("Loss and events", body, "nats/token", legend,
                     "Event markers share the loss curve's step axis; hover one for its detail.")
    else:
        loss = panel("Loss and events", nodata("no metrics.jsonl records and no events"))
    panels = [step_panel(run, "Learning rate", "optim/lr", "lr", PURPLE),
              step_panel(run, "Gradient norm", "optim/grad_norm", "grad norm", RED),
              step_panel(run, "Throughput", "throughput/tokens_per_s", "tokens/s", GREEN, unit="tokens/s", zero=True),
              step_panel(run, "MFU", "throughput/mfu", "MFU", CYAN, factor=100, unit="%", zero=True,
                         why="the device's peak FLOP/s is unknown (monitor.peak_flops)"),
              step_time(run),
              step_panel(run, "Peak memory, largest rank", "memory/peak_bytes_max_rank", "peak", SLATE,
                         factor=2 ** -30, unit="GiB", zero=True)]
    return f'<h2>Training</h2>{loss}<div class="grid" style="margin-top:12px">{"".join(panels)}</div>'


def downstream(run: Run) -> str:
    """The downstream tasks evaluated during training (eval.downstream_tasks): one panel per task, a line per
    metric (`eval/TASK/METRIC` records)."""
    keys = sorted({k for r in run.metrics for k in r if k.startswith("eval/") and not k.endswith("_stderr")})
    tasks: dict[str, list[str]] = {}
    for key in keys:
        tasks.setdefault(key.split("/")[1], []).append(key)
    if not tasks:
        return ""
    panels = []
    for task, metrics in tasks.items():
        series = [_series(trajectory(run.metrics, key)[0], key, key.split("/", 2)[2],
                          LAYER_COLORS[i % len(LAYER_COLORS)], dots=True) for i, key in enumerate(metrics)]
        panels.append(panel(task, line_chart(series, label=task), legend=[(s.name, s.color) for s in series]))
    return (f'<h2>Downstream tasks</h2><p class="note">lm-evaluation-harness every eval.downstream_interval '
            f'steps.</p><div class="grid">{"".join(panels)}</div>')


SIGNALS = (("Largest attention logit, per layer", "signals/attn_logit_max"),
           ("Activation RMS, per layer", "signals/act_rms"), ("Update RMS, per layer", "signals/update_rms"),
           ("Share of float8 inputs flushed to zero, per layer", "signals/float8_underflow"))
LAYER_COLORS = (BLUE, ORANGE, GREEN, PURPLE, RED, CYAN, AMBER, SLATE)


def signals(run: Run) -> str:
    """The instability signals of the sampled steps (monitor.signals_interval), when the run recorded them."""
    sampled = [r for r in run.metrics if "signals/attn_logit_max" in r]
    if not sampled:
        return ""
    layers = sorted({int(k.rsplit("_", 1)[1]) for r in sampled for k in r if k.startswith("signals/act_rms/layer_")})
    panels = []
    for title, prefix in SIGNALS:
        if not any(f"{prefix}/layer_{i}" in r for r in sampled for i in layers):  # float8's: a float8 run's only
            continue
        series = [_series(trajectory(run.metrics, f"{prefix}/layer_{i}")[0], f"{prefix}/layer_{i}", f"layer {i}",
                          LAYER_COLORS[i % len(LAYER_COLORS)]) for i in layers]
        panels.append(panel(title, line_chart(series, label=title), legend=[(s.name, s.color) for s in series]))
    log_z = [_series(trajectory(run.metrics, key)[0], key, name, color)
             for key, name, color in (("signals/log_z_mean", "mean", BLUE), ("signals/log_z_max", "max", RED))]
    panels.append(panel("Output logits' log Z", line_chart(log_z, label="log Z"),
                        legend=[(s.name, s.color) for s in log_z]))
    return (f'<h2>Instability signals</h2><p class="note">Sampled every monitor.signals_interval steps; each record '
            f'holds the latest sample.</p><div class="grid">{"".join(panels)}</div>')


EXPERT_LOADS = re.compile(r"moe/load/layer_(\d+)")
MAX_COLUMNS, MAX_CELLS = 160, 200_000  # heat-map columns of a layer, and cells of all layers: a light page
FAIR_SCALE = ((0.125, "≤ 0.125×"), (0.25, "0.25×"), (0.5, "0.5×"), (1.0, "1×"), (2.0, "2×"), (4.0, "4×"),
              (8.0, "≥ 8×"))


def fair_color(of_fair: float) -> str:
    """An expert's load as a multiple of the fair share: white at 1, red as it falls to 1/8 and below (none at
    all included), blue as it rises to 8 times and above."""
    return diverging(math.log2(of_fair) / 3 if of_fair > 0 else -1.0)


def load_columns(records: list[dict], key: str, limit: int) -> tuple[list[float], list[list[float]]]:
    """The steps and, for each, every expert's load as a multiple of the fair share; past `limit` logged
    records, consecutive ones are averaged into one column that ends at the last one's step."""
    n, buckets = len(records), min(len(records), limit)
    steps, columns = [], []
    for b in range(buckets):
        chunk = [r[key] for r in records[b * n // buckets:(b + 1) * n // buckets]]
        steps.append(records[(b + 1) * n // buckets - 1]["step"])
        experts = len(chunk[0])
        columns.append([experts * sum(c[e] for c in chunk) / len(chunk) for e in range(experts)])
    return steps, columns


def _load_map(records: list[dict], layer: int, limit: int) -> str:
    key = f"moe/load/layer_{layer}"
    steps, columns = load_columns(records, key, limit)
    experts = len(columns[0])

    def describe(expert: int, after: float, until: float, low: float, high: float) -> str:
        load = f"{low:.2f}×" if high - low < 0.005 else f"{low:.2f}–{high:.2f}×"
        return f"expert {expert} · steps {math.floor(after) + 1}–{until:.0f} · {load} the fair load"

    chart = heat_map(steps, [[column[e] for column in columns] for e in range(experts)], fair_color,
                     row_names=[f"expert {e}" for e in range(experts)], describe=describe,
                     label=f"expert load, layer {layer}")
    averaged = f" Each column averages {len(records) / len(steps):.1f} logged intervals." if len(steps) < len(
        records) else ""
    return '<div style="margin-bottom:12px">' + panel(
        f"Layer {layer}: each expert's load", chart, f"{experts} experts × {len(records)} logged intervals",
        note=f"A column is the interval up to its step.{averaged}") + "</div>"


def experts(run: Run) -> str:
    """A mixture-of-experts run's routing (keel.train.experts): per layer, a heat map of each expert's load over
    the logged intervals, and the layers' imbalance, router entropy and balancing biases' spread over steps."""
    layers = sorted({int(m.group(1)) for r in run.metrics for k in r if (m := EXPERT_LOADS.fullmatch(k))})
    loads = {layer: [r for r in trajectory(run.metrics, f"moe/load/layer_{layer}")[0]
                     if isinstance(r[f"moe/load/layer_{layer}"], list) and r[f"moe/load/layer_{layer}"]]
             for layer in layers}
    loads = {layer: records for layer, records in loads.items() if records}
    if not loads:
        return ""
    widest = max(len(records[0][f"moe/load/layer_{layer}"]) for layer, records in loads.items())
    limit = min(MAX_COLUMNS, max(16, MAX_CELLS // (len(loads) * widest)))
    scale = "".join(f'<i style="background:{fair_color(v)};height:10px;width:22px;border:1px solid #e5e7eb"></i>'
                    f'{name}' for v, name in FAIR_SCALE)
    lines = [layer_lines(run, "moe/imbalance", list(loads), "Imbalance (busiest expert's load ÷ the fair load)"),
             layer_lines(run, "moe/entropy", list(loads), "Router entropy per token (nats)"),
             layer_lines(run, "moe/bias_spread", list(loads), "Balancing biases' spread (max − min)")]
    if any(k.startswith("moe/dropped_tokens/") for r in run.metrics for k in r):
        lines.append(layer_lines(run, "moe/dropped_tokens", list(loads), "Dropped tokens per interval"))
    return (f'<h2>Mixture of experts</h2><p class="note">Each expert\'s share of its layer\'s tokens over each logged '
            f'interval, as a multiple of the fair share (1 / experts): white is fair, red starved (a collapsed expert '
            f'is a red row), blue overloaded.</p><div class="legend">{scale}</div>'
            f'{"".join(_load_map(records, layer, limit) for layer, records in loads.items())}'
            f'<div class="grid">{"".join(lines)}</div>')


def layer_lines(run: Run, prefix: str, layers: list[int], title: str) -> str:
    """A line per layer of the `PREFIX/layer_N` metrics."""
    series = [_series(trajectory(run.metrics, f"{prefix}/layer_{i}")[0], f"{prefix}/layer_{i}", f"layer {i}",
                      LAYER_COLORS[i % len(LAYER_COLORS)]) for i in layers]
    return panel(title, line_chart(series, label=title), legend=[(s.name, s.color) for s in series])


def step_panel(run: Run, title: str, key: str, name: str, color: str, factor: float = 1.0, unit: str = "",
               zero: bool = False, why: str = "") -> str:
    kept, _ = trajectory(run.metrics, key)
    if not any(finite(r[key]) for r in kept):
        return panel(title, nodata(why if kept else ""), unit)
    return panel(title, line_chart([_series(kept, key, name, color, factor)], zero=zero, label=title), unit)


def step_time(run: Run) -> str:
    kept = [r for r in trajectory(run.metrics, "time/step_s")[0] if finite(r["time/step_s"])]
    if not kept:
        return panel("Step time", nodata(), "s")
    parts = [(key, name, color) for key, name, color in STEP_TIME if any(key in r for r in kept)]
    layers = [(name, [r.get(key) for r in kept], color) for key, name, color in parts]
    rest = [max(0.0, r["time/step_s"] - sum(r[k] for k, _, _ in parts if finite(r.get(k)))) for r in kept]
    layers.append(("other" if parts else "step", rest, "#cbd5e1"))
    comm, _ = trajectory(run.metrics, "time/comm_s")
    overlay = [_series(comm, "time/comm_s", "comm (profiled steps)", RED, dash="4 2")] if comm else []
    body = stacked_chart([r["step"] for r in kept], layers, overlay=overlay, label="step time")
    legend = [(n, c) for n, _, c in layers] + [(s.name, s.color) for s in overlay]
    note = "Time in collectives overlaps the forward/backward; it is drawn as a line, not stacked." if overlay else ""
    return panel("Step time", body, "s per step", legend, note)


def goodput(run: Run) -> str:
    g = run.goodput
    buckets = {k: v for k, v in (g.get("buckets") or {}).items() if finite(v)}
    total = sum(buckets.values())
    if total <= 0:
        return "<h2>Goodput</h2>" + panel("Where the wall time went", nodata("no goodput.json"))
    order = [k for k in BUCKETS if buckets.get(k)] + [k for k in buckets if k not in BUCKETS and buckets[k]]
    items = [(k.replace("_", " "), buckets[k], BUCKETS.get(k, SLATE), f"{fmt_duration(buckets[k])} · "
              f"{buckets[k] / total:.1%}") for k in order]
    facts = [f"goodput ratio {buckets.get('productive', 0.0) / total:.1%} of {fmt_duration(total)}",
             f"{g.get('attempts', '-')} start(s)", f"{g.get('recomputed_steps', 0)} recomputed step(s)"]
    facts += [f"restored from {tier}: {fmt_duration(seconds)}" for tier, seconds in
              sorted((g.get("restore_s_by_tier") or {}).items()) if finite(seconds)]
    if g.get("ended"):
        facts.append(f"ended: {g['ended']}")
    bars = panel("Where the wall time went", bar_chart(items, width=600, label="goodput buckets"),
                 note=" · ".join(facts))
    xs, ys = [], []
    for h in g.get("history") or []:
        hb = h.get("buckets") or {} if isinstance(h, dict) else {}
        htotal = sum(v for v in hb.values() if finite(v))
        if finite(h.get("time")) and htotal > 0 and finite(g.get("started")):
            xs.append(h["time"] - g["started"])
            ys.append(100 * hb.get("productive", 0.0) / htotal)
    ratio = (line_chart([Series("goodput ratio", xs, ys, GREEN)], y_domain=(0, 100), x_fmt=fmt_duration,
                        seconds=True, label="goodput ratio over time") if xs else nodata("no history"))
    return f'<h2>Goodput</h2><div class="grid">{bars}{panel("Goodput ratio over wall time", ratio, "%")}</div>'


def _labels(key: str) -> tuple[str, tuple]:
    """`gpu_temperature_celsius{gpu=0}` → name and label pairs (numbers sort as numbers)."""
    m = re.fullmatch(r"([^{]+)(?:\{(.*)\})?", key)
    name, raw = (m.group(1), m.group(2) or "") if m else (key, "")
    pairs = [p.split("=", 1) for p in raw.split(",") if "=" in p]
    return name, tuple((k, int(v) if v.isdigit() else v) for k, v in pairs)


def hardware(run: Run, t0: float | None) -> str:
    if not run.telemetry:
        off = [short_detail(e.get("detail")) for e in run.events if e.get("kind") == "telemetry"]
        return "<h2>Hardware</h2>" + panel("Telemetry", nodata("no telemetry.jsonl" + (f" ({'; '.join(off[:3])})"
                                                                                       if off else "")))
    data: dict[tuple, tuple[list[float], list[float | None]]] = {}
    times = [r["time"] for r in run.telemetry if finite(r.get("time"))]
    start = t0 if t0 is not None else min(times, default=0.0)
    for record in run.telemetry:
        if not finite(record.get("time")) or not isinstance(record.get("readings"), dict):
            continue
        for key, value in record["readings"].items():
            name, labels = _labels(key)
            if name in TELEMETRY:
                xs, ys = data.setdefault((str(record.get("node", "?")), list(TELEMETRY).index(name), name, labels),
                                         ([], []))
                xs.append(record["time"] - start)
                ys.append(value if finite(value) else None)
    span = domain([x for xs, _ in data.values() for x in xs], nice=False)  # one time axis for every panel
    panels: list[str] = []
    quiet: dict[tuple[str, str], int] = {}
    for node, _, name, labels in sorted(data):
        xs, ys = data[(node, _, name, labels)]
        title, factor, unit = TELEMETRY[name]
        if unit == "since start":  # a counter: its increase during the run
            base = next((y for y in ys if y is not None), 0.0)
            ys = [None if y is None else y - base for y in ys]
            if not any(ys):
                quiet[(node, title)] = quiet.get((node, title), 0) + 1
                continue
        label = " ".join(f"{k} {v}" for k, v in labels)
        chart = line_chart([Series(title, xs, [None if y is None else y * factor for y in ys], BLUE)], width=290,
                           height=120, zero=unit != "°C", x_domain=span, x_fmt=fmt_duration, seconds=True, label=title,
                           y_domain=(0, 100) if unit == "%" else None)
        panels.append(panel(f"{node} · {title}{f' · {label}' if label else ''}", chart, unit))
    note = f"{len(panels) - MAX_PANELS} more series not shown. " if len(panels) > MAX_PANELS else ""
    if quiet:
        note += "No increase during the run: " + ", ".join(f"{title} on {node} ({n} series)"
                                                            for (node, title), n in quiet.items()) + "."
    body = f'<div class="small">{"".join(panels[:MAX_PANELS])}</div>' if panels else nodata()
    return f'<h2>Hardware</h2>{body}{f"<p class=note>{escape(note)}</p>" if note else ""}'


def event_table(events: list[dict]) -> str:
    if not events:
        return "<h2>Events</h2>" + panel("Events", nodata("no events.jsonl"))
    rows = []
    grouped = any("group" in e for e in events)  # the merged events of a run's replica groups
    for e in events[-MAX_ROWS:]:
        detail = e.get("detail")
        full = json.dumps(detail, default=str)[:1000]
        group = f'<td class="num">{e.get("group", "")}</td>' if grouped else ""
        rows.append(f'<tr class="{severity(e)}"><td>{_when(e.get("time"))}</td>{group}<td class="num">'
                    f'{e.get("step", "")}</td><td class="num">{e.get("rank", "")}</td>'
                    f'<td>{escape(str(e.get("kind", "")))}</td><td>{escape(str(e.get("action", "")))}</td>'
                    f'<td title="{escape(full)}">{escape(short_detail(detail))}</td></tr>')
    more = f'<p class="note">{len(events) - MAX_ROWS} earlier events not shown.</p>' if len(events) > MAX_ROWS else ""
    return (f'<h2>Events</h2>{more}<table><thead><tr><th>time</th>{"<th>group</th>" if grouped else ""}'
            f'<th>step</th><th>rank</th><th>kind</th><th>action</th><th>detail</th></tr></thead>'
            f'<tbody>{"".join(rows)}</tbody></table>')


def live_groups(groups: list[Run], t0: float) -> str:
    """The number of live groups over wall time: what each group's quorum found, held until the next one."""
    found = by_time([e for run in groups for e in run.events if e.get("kind") == "quorum" and finite(e.get("time"))
                     and finite((e.get("detail") or {}).get("participants"))])
    if not found:
        return panel("Live replica groups", nodata("no quorum events"))
    last = max(e["time"] for run in groups for e in run.events if finite(e.get("time")))
    xs, ys = stepwise([e["time"] - t0 for e in found], [e["detail"]["participants"] for e in found], last - t0)
    chart = line_chart([Series("live groups", xs, ys, GREEN)], x_domain=(0.0, max(xs[-1], 1.0)),
                       y_domain=(0, len(groups)), x_fmt=fmt_duration, seconds=True, label="live replica groups")
    return panel("Live replica groups", chart, "groups in the quorum",
                 note="At each quorum of any group; a lost group counts until the survivors' next quorum.")


def heal_table(groups: list[dict], runs: list[Run]) -> str:
    records = by_time(tagged(groups, [quorum_events(r.events, "heal") + quorum_events(r.events, "retry")
                                      for r in runs]))
    if not records:
        return panel("Heals and retries", nodata("no group healed and no step was made again"))
    rows = []
    for e in records:
        detail = e.get("detail") or {}
        heal_s = fmt_duration(detail["heal_s"]) if e["action"] == "heal" and finite(detail.get("heal_s")) else ""
        rows.append(f'<tr class="{"warn" if e["action"] == "retry" else ""}"><td>{_when(e.get("time"))}</td>'
                    f'<td class="num">{e["group"]}</td><td>{escape(str(e["action"]))}</td>'
                    f'<td class="num">{e.get("step", "")}</td><td class="num">{heal_s}</td>'
                    f'<td class="num">{detail.get("participants", "")}</td></tr>')
    return panel("Heals and retries", f'<table class="heals"><thead><tr><th>time</th><th>group</th><th>what</th>'
                 f'<th>step</th><th>heal time</th><th>groups in the quorum</th></tr></thead><tbody>{"".join(rows)}'
                 f'</tbody></table>')


def group_goodput(groups: list[dict], runs: list[Run]) -> str:
    items = []
    for g, run in zip(groups, runs, strict=True):
        ratio = goodput_ratio(run.goodput)
        total = sum(v for v in (run.goodput.get("buckets") or {}).values() if finite(v))
        items.append((f"group {g['group']}", 100 * (ratio or 0.0), GREEN, f"{ratio:.1%} of {fmt_duration(total)}"
                      if ratio is not None else "no goodput.json"))
    return panel("Goodput of each group", bar_chart(items, width=600, label="goodput of each group"),
                 note="Productive time over the group's wall time; a restarted group's time down counts against it.")


def replica_section(groups: list[dict], runs: list[Run], t0: float) -> str:
    return (f'<h2>Replica groups</h2><div class="grid">{live_groups(runs, t0)}{group_goodput(groups, runs)}</div>'
            f'<div style="margin-top:12px">{heal_table(groups, runs)}</div>')


def header(run: Run, info: dict) -> str:
    state, step, total = info["state"], info["step"], info["total_steps"]
    ratio = info["goodput_ratio"]
    ckpt = info["last_checkpoint"]
    cards = [("step", f"{step:,}" + (f" / {total:,}" if total else ""), ""),
             ("tokens", fmt_num(info["tokens_seen"]) if finite(info["tokens_seen"]) else "-", ""),
             ("wall time", fmt_duration(info["wall_s"]) if info["wall_s"] is not None else "-", ""),
             ("goodput", f"{ratio:.1%}" if ratio is not None else "-", ""),
             ("train loss", f"{info['train_loss']['value']:.4f}" if info["train_loss"] else "-", ""),
             ("validation loss", f"{info['val_loss']['value']:.4f}" if info["val_loss"] else "-", ""),
             ("last checkpoint", Path(ckpt).name if ckpt else "none", ckpt or "")]
    if info["eta_s"] is not None and state == "running":
        cards.insert(1, ("ETA", fmt_duration(info["eta_s"]), ""))
    html = "".join(f'<div class="card"><span>{k}</span><b title="{escape(t or v)}">{escape(v)}</b>'
                   + (f'<div class="progress"><div style="width:{min(100, 100 * step / total):.1f}%"></div></div>'
                      if k == "step" and total else "") + "</div>" for k, v, t in cards)
    model = run.config.get("model", {})
    start: object = next((e.get("detail", {}) for e in reversed(run.events) if e.get("kind") == "start"), {})
    about = [f"run directory {run.path}"]
    if model:
        about.append(f"model dim {model.get('dim')} × {model.get('n_layers')} layers")
    if isinstance(start, dict) and start.get("world_size"):
        about.append(f"{start['world_size']} process(es) on {start.get('device', '?')}")
    about.append(f"report written {_when(time.time())}")
    reason = f'<p class="sub">reason: {escape(info["reason"])}</p>' if info["reason"] else ""
    return (f'<h1>{escape(str(info["name"]))}<span class="badge" style="background:{STATE_COLOR.get(state, SLATE)}">'
            f'{escape(state)}</span></h1><p class="sub">{escape(" · ".join(about))}</p>{reason}'
            f'<div class="cards">{html}</div>')


def replica_page(top: Run, dirs: list[Path]) -> str:
    """A run of replica groups: the run as a whole, its groups' quorum, the furthest group's curves (every
    live group computes the same) and every group's events; each group's own report has the rest."""
    info = replica_summary(top.path, dirs, events=0)
    runs = [load_run(d) for d in dirs]
    lead = runs[max(range(len(runs)), key=lambda i: info["groups"][i]["step"])]
    times = [e["time"] for run in (top, *runs) for e in run.events if finite(e.get("time"))]
    events = by_time(top.events + tagged(info["groups"], [r.events for r in runs]))
    own = f'<p class="note">Each group\'s own report: keel report {escape(str(dirs[0].parent))}/G.</p>'
    return (header(replace(lead, path=top.path), info) + replica_section(info["groups"], runs, min(times, default=0.0))
            + own + training(lead) + event_table(events))


def render(run: Run, drill: dict | None = None) -> str:
    """The run's page, with the failure drills' scorecard when `keel drill` left one; a drill's work directory
    alone (no run of its own) gets the scorecard only."""
    drills = drill_section(drill) if drill else ""
    dirs = group_dirs(run.path)
    if dirs:
        body = replica_page(run, dirs)
        title = f"{run.config.get('name') or run.path.name} · keel run report"
    elif drill and not (run.metrics or run.events):
        title = f"{run.path.name} · keel failure drills"
        body = f'<h1>{escape(run.path.name)}</h1><p class="sub">{escape(str(run.path))}</p>{drills}'
    else:
        info = summarize(run, events=1)
        title = f"{info['name']} · keel run report"
        starts = [e["time"] for e in run.events if e.get("kind") == "start" and finite(e.get("time"))]
        t0 = run.goodput["started"] if finite(run.goodput.get("started")) else min(starts, default=None)
        body = (header(run, info) + drills + training(run) + downstream(run) + signals(run) + experts(run)
                + goodput(run) + hardware(run, t0) + event_table(run.events))
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><meta name="viewport" '
            f'content="width=device-width, initial-scale=1"><title>{escape(title)}'
            f'</title><style>{CSS}</style></head><body><main>{body}</main></body></html>\n')
