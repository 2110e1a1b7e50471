"""The sweep's HTML pages. The coordinate check's: for each parametrization and step, the RMS of every layer's
output over its RMS at the base width, against the width (log scale), one line per layer: flat lines at 1 are
width-independent coordinates. The sweep's: per series, the loss against the learning rate per width with the
optimum marked, the LR sensitivity of each width, the optimum's drift and the recommended learning rate."""

from __future__ import annotations

import math
from html import escape
from pathlib import Path

from keel.report.html import CSS, LAYER_COLORS
from keel.report.svg import Series, line_chart
from keel.sweep.coord_check import CoordCheck


def write_page(check: CoordCheck, path: Path) -> Path:
    xs = [math.log2(k * check.base_dim) for k in check.multipliers]
    panels = []
    for parametrization, readings in check.rms.items():
        for step in range(1, check.steps + 1):
            base = readings[check.multipliers[0]][step - 1]
            series = [Series(layer, xs, [readings[k][step - 1][i] / base[i] for k in check.multipliers],
                             LAYER_COLORS[i % len(LAYER_COLORS)], dots=True) for i, layer in enumerate(check.layers)]
            title = (f"{parametrization}, step {step}: output RMS over the base width's, against the width; "
                     f"blocks at the widest {check.growth(parametrization, step):.2f}×")
            panels.append(f"<section class='panel'><h3>{escape(title)}</h3>"
                          f"{line_chart(series, width=420, x_fmt=lambda v: f'{2 ** v:.0f}')}</section>")
    legend = ", ".join(f"<span style='color:{LAYER_COLORS[i % len(LAYER_COLORS)]}'>{escape(layer)}</span>"
                       for i, layer in enumerate(check.layers))
    path.write_text(f"<!doctype html><html><head><meta charset='utf-8'><title>keel coordinate check</title>"
                    f"<style>{CSS}</style></head><body><main><h1>Coordinate check</h1><p class='sub'>widths "
                    f"{', '.join(str(k * check.base_dim) for k in check.multipliers)}; lines: {legend}</p>"
                    f"{''.join(panels)}</main></body></html>\n")
    return path


def _fmt(v: float | None, spec: str = ".4f") -> str:
    return "-" if v is None else format(v, spec)


def _series_section(series: dict, target: dict | None) -> str:
    """One series: loss against the learning rate per width (the optimum circled), then the per-width table,
    the transfer evidence and, with a target, the recommended learning rate."""
    lines = []
    for i, w in enumerate(series["widths"]):
        color = LAYER_COLORS[i % len(LAYER_COLORS)]
        lines.append(Series(f"width {w['width']}", [math.log10(lr) for lr in w["lrs"]], w["losses"], color, dots=True))
        if w["optimum_lr"] is not None:  # a dashed vertical line from the best loss up to the worst
            x, top = math.log10(w["optimum_lr"]), max(v for v in w["losses"] if v is not None)
            lines.append(Series(f"optimum of width {w['width']}", [x, x], [w["best_loss"], top], color, dash="3 3"))
    chart = line_chart(lines, width=560, height=240, x_fmt=lambda v: f"{10 ** v:.2g}",
                       label="loss against the peak learning rate (log scale), one line per width")
    rows = "".join(f"<tr><td>{w['width']}</td><td>{w['params']:,}</td><td>{_fmt(w['optimum_lr'], '.3g')}"
                   f"{' (grid edge)' if w['optimum_at_edge'] else ''}</td><td>{_fmt(w['best_loss'])}</td>"
                   f"<td>{w['sensitivity']:.4f}</td></tr>" for w in series["widths"])
    t = series["transfer"]
    evidence = ("no width has a finite loss" if t["drift"] is None else
                f"the optimum moves {t['drift']:.2f}× ({t['grid_steps']:.1f} grid steps) across widths "
                f"{', '.join(map(str, t['widths']))}" + ("" if t["slope"] is None else
                                                       f"; fitted lr* ∝ width^{t['slope']:.2f}"))
    rec = ""
    if target is not None and (lr := target["lrs"].get(series["group"])) is not None:
        rec = f"<p><b>Recommended learning rate at width {target['width']}: {lr:.3g}</b></p>"
    legend = "".join(f"<span style='color:{LAYER_COLORS[i % len(LAYER_COLORS)]}'>width {w['width']}</span> "
                     for i, w in enumerate(series["widths"]))
    return (f"<section class='panel'><h2>{escape(series['group'] or 'all points')}</h2><p class='sub'>{legend}"
            f"</p>{chart}<table><tr><th>width</th><th>parameters</th><th>optimal lr</th><th>best loss</th>"
            f"<th>LR sensitivity</th></tr>{rows}</table><p>{escape(evidence)}</p>{rec}</section>")


def write_sweep_page(result: dict, path: Path, target: dict | None = None) -> Path:
    head = (f"{len(result['points'])} points of {result['steps']} steps; grid "
            + "; ".join(f"{k} = {', '.join(v)}" for k, v in result["grid"].items())
            + f"; loss: final {result['metric'].replace('_', ' ')}")
    body = "".join(_series_section(s, target) for s in result["series"]) or "<p>no point has finished yet</p>"
    path.write_text(f"<!doctype html><html><head><meta charset='utf-8'><title>keel sweep</title><style>{CSS}"
                    f"</style></head><body><main><h1>Sweep</h1><p class='sub'>{escape(head)}</p>{body}</main>"
                    f"</body></html>\n")
    return path
