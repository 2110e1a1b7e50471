"""The coordinate check's HTML page: for each parametrization and step, the RMS of every layer's output over
its RMS at the base width, against the width (log scale), one line per layer: flat lines at 1 are
width-independent coordinates."""

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
