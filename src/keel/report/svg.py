"""Small SVG charts for the run report: lines with gaps, stacked areas, horizontal bars, and lanes of
event markers that share a line chart's x axis. Plain strings, no dependencies: the report opens offline."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from html import escape
from typing import TypeGuard

MAX_POINTS = 1500  # per series: more points than pixels only make the page heavy
LEFT, RIGHT, TOP, BOTTOM = 66, 14, 8, 22
LANE_H = 15
GRID, AXIS_TEXT = "#e5e7eb", "#6b7280"

Point = tuple[float, float] | None  # None: a gap (a missing or non-finite value)
Fmt = Callable[[float], str]


def finite(v: object) -> TypeGuard[float]:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


@dataclass
class Series:
    name: str
    xs: Sequence[float]
    ys: Sequence[float | None]
    color: str
    dash: str = ""
    opacity: float = 1.0
    dots: bool = False  # a circle on every point (sparse series such as validation loss)


@dataclass
class Marker:
    x: float
    lane: int
    color: str
    title: str
    radius: float = 4.0


def fmt_num(v: float) -> str:
    a = abs(v)
    for above, scale, suffix in ((1e12, 1e12, "T"), (1e9, 1e9, "G"), (1e6, 1e6, "M"), (1e4, 1e3, "k")):
        if a >= above:
            return f"{v / scale:.3g}{suffix}"
    return f"{v:.0f}" if a >= 100 else f"{v:.3g}".replace("e-0", "e-")


def fmt_duration(seconds: float) -> str:
    s = abs(seconds)
    if s < 60:
        return f"{seconds:.3g}s" if s < 10 else f"{seconds:.0f}s"
    if s < 3600:
        m, r = divmod(round(s), 60)
        return f"{m}m" + (f"{r:02d}s" if r else "")
    if s < 48 * 3600:
        h, r = divmod(round(s / 60), 60)
        return f"{h}h" + (f"{r:02d}m" if r else "")
    return f"{s / 86400:.1f}d"


def nice_step(span: float, n: int = 5) -> float:
    raw = span / n
    mag = 10 ** math.floor(math.log10(raw))
    return next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw * 0.999)


def ticks(lo: float, hi: float, n: int = 5, seconds: bool = False) -> list[float]:
    if seconds and hi - lo >= 120:  # round minutes and hours on a time axis
        steps = [60 * m for m in (1, 2, 5, 10, 15, 30)] + [3600 * h for h in (1, 2, 3, 6, 12, 24, 48)]
        step = next((s for s in steps if s >= (hi - lo) / n), nice_step(hi - lo, n))
    else:
        step = nice_step(hi - lo, n)
    first = math.ceil(lo / step - 1e-9)
    return [k * step for k in range(first, int(math.floor(hi / step + 1e-9)) + 1)]


def domain(values: Sequence[float | None], zero: bool = False, nice: bool = True) -> tuple[float, float]:
    vals = [v for v in values if finite(v)]
    if not vals:
        return (0.0, 1.0)
    lo, hi = min(vals), max(vals)
    if zero:
        lo, hi = min(lo, 0.0), max(hi, 0.0)
    if hi - lo < 1e-12 * max(1.0, abs(hi)):
        pad = abs(hi) * 0.1 or 1.0
        lo, hi = lo - pad, hi + pad
    if nice:
        step = nice_step(hi - lo)
        lo, hi = math.floor(lo / step + 1e-9) * step, math.ceil(hi / step - 1e-9) * step
    return (lo, hi)


def downsample(xs: Sequence[float], ys: Sequence[float | None], limit: int = MAX_POINTS) -> list[Point]:
    """The points to draw. Past `limit`, runs of consecutive points become buckets that keep their lowest
    and highest values (spikes survive), and a bucket holding a gap keeps it between its extremes."""
    pts: list[Point] = [(x, y) if finite(y) else None for x, y in zip(xs, ys, strict=True)]
    if len(pts) <= limit:
        return pts
    per = 4 if None in pts else 2
    buckets = limit // per
    out: list[Point] = []
    for b in range(buckets):
        chunk = pts[b * len(pts) // buckets:(b + 1) * len(pts) // buckets]
        if None in chunk:
            first, last = chunk.index(None), len(chunk) - 1 - chunk[::-1].index(None)
            out += [*_extremes(chunk[:first]), None, *_extremes(chunk[last + 1:])]
        else:
            out += _extremes(chunk)
    return out


def stepwise(xs: Sequence[float], ys: Sequence[float], until: float | None = None) -> tuple[list[float], list[float]]:
    """The points of a step chart: each value holds until the next one (and the last until `until`)."""
    out_x, out_y = [], []
    for i, (x, y) in enumerate(zip(xs, ys, strict=True)):
        if i:
            out_x.append(x)
            out_y.append(ys[i - 1])
        out_x.append(x)
        out_y.append(y)
    if ys and until is not None and until > xs[-1]:
        out_x.append(until)
        out_y.append(ys[-1])
    return out_x, out_y


def _extremes(chunk: list[Point]) -> list[Point]:
    if not chunk:
        return []
    lo = min(range(len(chunk)), key=lambda i: chunk[i][1])  # type: ignore[index]
    hi = max(range(len(chunk)), key=lambda i: chunk[i][1])  # type: ignore[index]
    return [chunk[i] for i in sorted({lo, hi})]


class Frame:
    """The plot area of a chart of `width` x `height`, with an optional band of event lanes under it
    that uses the same x scale."""

    def __init__(self, width: float, height: float, xd: tuple[float, float], yd: tuple[float, float],
                 lanes: int = 0) -> None:
        self.width, self.xd, self.yd = width, xd, yd
        self.x0, self.x1 = LEFT, width - RIGHT
        self.y0, self.y1 = TOP, height - BOTTOM  # top and bottom of the plot area
        self.lane_top = self.y1 + (6 if lanes else 0)
        self.height = height + (lanes * LANE_H + 6 if lanes else 0)

    def x(self, v: float) -> float:
        lo, hi = self.xd
        return self.x0 + (v - lo) / ((hi - lo) or 1.0) * (self.x1 - self.x0)

    def y(self, v: float) -> float:
        lo, hi = self.yd
        return self.y1 - (min(max(v, lo), hi) - lo) / ((hi - lo) or 1.0) * (self.y1 - self.y0)

    def lane_y(self, lane: int) -> float:
        return self.lane_top + lane * LANE_H + LANE_H / 2

    def axes(self, x_fmt: Fmt, y_fmt: Fmt, seconds: bool = False) -> list[str]:
        bottom = self.height - BOTTOM
        out = []
        for v in ticks(*self.yd, n=4):
            y = f"{self.y(v):.1f}"
            out.append(f'<line x1="{self.x0}" x2="{self.x1}" y1="{y}" y2="{y}" stroke="{GRID}"/>'
                       f'<text x="{self.x0 - 5}" y="{y}" dy="3.5" text-anchor="end">{escape(y_fmt(v))}</text>')
        for v in ticks(*self.xd, n=max(2, int((self.x1 - self.x0) / 110)), seconds=seconds):
            x = f"{self.x(v):.1f}"
            out.append(f'<line x1="{x}" x2="{x}" y1="{self.y0}" y2="{bottom}" stroke="{GRID}"/>'
                       f'<text x="{x}" y="{bottom + 14}" text-anchor="middle">{escape(x_fmt(v))}</text>')
        out.append(f'<line x1="{self.x0}" x2="{self.x1}" y1="{self.y1}" y2="{self.y1}" stroke="#9ca3af"/>')
        return out


def _svg(frame: Frame, body: list[str], label: str) -> str:
    w, h = frame.width, f"{frame.height:.0f}"
    return (f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {w} {h}" width="{w}" height="{h}" role="img" '
            f'aria-label="{escape(label)}" font-size="10" fill="{AXIS_TEXT}">' + "".join(body) + "</svg>")


def _polyline(frame: Frame, s: Series) -> str:
    runs: list[list[tuple[float, float]]] = [[]]
    for p in downsample(s.xs, s.ys):
        if p is None:
            runs.append([])
        else:
            runs[-1].append((frame.x(p[0]), frame.y(p[1])))
    d = "".join("M" + "L".join(f"{x:.1f},{y:.1f}" for x, y in run) for run in runs if len(run) > 1)
    style = f'stroke="{s.color}" stroke-width="1.6" fill="none" stroke-linejoin="round"'
    style += f' stroke-dasharray="{s.dash}"' if s.dash else ""
    style += f' opacity="{s.opacity}"' if s.opacity < 1 else ""
    out = f'<path class="series" data-name="{escape(s.name)}" {style} d="{d}"/>' if d else ""
    dots = [pt for run in runs for pt in run] if s.dots else [run[0] for run in runs if len(run) == 1]
    r = 2.6 if s.dots else 2.2
    out += "".join(f'<circle class="point" data-name="{escape(s.name)}" cx="{x:.1f}" cy="{y:.1f}" r="{r}" '
                   f'fill="{s.color}"/>' for x, y in dots)
    return out


def line_chart(series: Sequence[Series], *, width: float = 600, height: float = 190,
               x_domain: tuple[float, float] | None = None, y_domain: tuple[float, float] | None = None,
               zero: bool = False, x_fmt: Fmt = fmt_num, y_fmt: Fmt = fmt_num, seconds: bool = False,
               lanes: Sequence[str] = (), markers: Sequence[Marker] = (), label: str = "") -> str:
    """Lines over a shared x axis; with `lanes`, a band of named lanes under the plot holds `markers`
    at the same x scale (an event at step s sits exactly under the curve's point for step s)."""
    xs = [x for s in series for x in s.xs] + [m.x for m in markers]
    xd = x_domain or domain(xs, nice=False)
    yd = y_domain or domain([y for s in series for y in s.ys], zero=zero)
    frame = Frame(width, height, xd, yd, len(lanes))
    body = frame.axes(x_fmt, y_fmt, seconds)
    for i, name in enumerate(lanes):
        y = frame.lane_y(i)
        body.append(f'<line x1="{frame.x0}" x2="{frame.x1}" y1="{y:.1f}" y2="{y:.1f}" stroke="#f1f5f9" '
                    f'stroke-width="{LANE_H - 3}"/><text x="{frame.x0 - 5}" y="{y:.1f}" dy="3.5" '
                    f'text-anchor="end">{escape(name)}</text>')
    body += [_polyline(frame, s) for s in series]
    for m in markers:
        body.append(f'<circle class="event" cx="{frame.x(m.x):.1f}" cy="{frame.lane_y(m.lane):.1f}" '
                    f'r="{m.radius}" fill="{m.color}" stroke="#fff" stroke-width="0.8">'
                    f'<title>{escape(m.title)}</title></circle>')
    return _svg(frame, body, label)


def stacked_chart(xs: Sequence[float], layers: Sequence[tuple[str, Sequence[float | None], str]], *,
                  overlay: Sequence[Series] = (), width: float = 600, height: float = 190, x_fmt: Fmt = fmt_num,
                  y_fmt: Fmt = fmt_num, label: str = "") -> str:
    """Layers stacked bottom to top (missing values count as 0); past MAX_POINTS // 2 points, buckets
    of consecutive points are averaged."""
    n = len(xs)
    buckets = min(n, MAX_POINTS // 2)
    spans = [(b * n // buckets, (b + 1) * n // buckets) for b in range(buckets)]
    bx = [sum(xs[i:j]) / (j - i) for i, j in spans]
    tops: list[list[float]] = []
    base = [0.0] * buckets
    for _, ys, _ in layers:
        base = [lo + sum(y for y in ys[i:j] if finite(y)) / (j - i) for lo, (i, j) in zip(base, spans, strict=True)]
        tops.append(base)
    peak = [*(tops[-1] if tops else []), *(y for s in overlay for y in s.ys)]
    frame = Frame(width, height, domain(bx + [x for s in overlay for x in s.xs], nice=False), domain(peak, zero=True))
    body = frame.axes(x_fmt, y_fmt)
    below = [0.0] * buckets
    for (name, _, color), top in zip(layers, tops, strict=True):
        upper = [f"{frame.x(x):.1f},{frame.y(y):.1f}" for x, y in zip(bx, top, strict=True)]
        lower = [f"{frame.x(x):.1f},{frame.y(y):.1f}" for x, y in zip(bx[::-1], below[::-1], strict=True)]
        body.append(f'<path class="layer" data-name="{escape(name)}" fill="{color}" fill-opacity="0.8" '
                    f'stroke="{color}" stroke-width="0.6" d="M{"L".join(upper + lower)}Z"><title>{escape(name)}'
                    f'</title></path>')
        below = top
    body += [_polyline(frame, s) for s in overlay]
    return _svg(frame, body, label)


def bar_chart(items: Sequence[tuple[str, float, str, str]], *, width: float = 600, label: str = "") -> str:
    """Horizontal bars: (label, value, colour, text written after the bar)."""
    row, left, right = 22, 130, 150
    top = max((v for _, v, _, _ in items), default=0.0) or 1.0
    frame = Frame(width, row * len(items) + 8, (0, 1), (0, 1))
    body = []
    for i, (name, value, color, note) in enumerate(items):
        y = 4 + i * row
        w = max(value / top * (width - left - right), 1.0 if value > 0 else 0.0)
        body.append(f'<text x="{left - 8}" y="{y + 14}" text-anchor="end" font-size="11" fill="#374151">'
                    f'{escape(name)}</text><rect x="{left}" y="{y + 3}" width="{w:.1f}" height="{row - 7}" rx="2" '
                    f'fill="{color}"><title>{escape(f"{name}: {note}")}</title></rect>'
                    f'<text x="{left + w + 6:.1f}" y="{y + 14}" font-size="11">{escape(note)}</text>')
    return _svg(frame, body, label)


def diverging(t: float, levels: int = 6) -> str:
    """A colour for t in [-1, 1]: white at 0, deepening to red at -1 and to blue at 1, in `levels` steps each
    way (so that neighbouring cells of one step merge into one shape)."""
    k = round(max(-1.0, min(1.0, t)) * levels) / levels
    end = (185, 28, 28) if k < 0 else (29, 78, 216)
    r, g, b = (round(255 + (c - 255) * abs(k)) for c in end)
    return f"#{r:02x}{g:02x}{b:02x}"


Describe = Callable[[int, float, float, float, float], str]  # (row, x from, x to, lowest, highest) → tooltip


def heat_map(xs: Sequence[float], rows: Sequence[Sequence[float | None]], color: Callable[[float], str], *,
             width: float = 1220, row_names: Sequence[str] = (), describe: Describe | None = None,
             label: str = "") -> str:
    """Rows of values over x (steps): the cell of column i spans from x[i-1] to x[i] (the interval a logged value
    sums up; the first is as wide as the second), filled with `color(value)`; a missing value is left blank.
    Cells of one row side by side with the same colour are one rectangle, whose tooltip is `describe(row, x
    from, x to, lowest value, highest value)`."""
    n = max(len(rows), 1)
    row_h = max(2.0, min(14.0, 220 / n))
    edges = [xs[0] - ((xs[1] - xs[0]) if len(xs) > 1 else 1.0), *xs] if xs else [0.0, 1.0]
    frame = Frame(width, TOP + n * row_h + BOTTOM, (edges[0], edges[-1]), (0.0, float(n)))
    body: list[str] = []
    every = math.ceil(11 / row_h)  # a row name every `every` rows, 11 px apart at least
    for r, values in enumerate(rows):
        y = frame.y0 + r * row_h
        if r % every == 0:
            name = row_names[r] if r < len(row_names) else str(r)
            body.append(f'<text x="{frame.x0 - 5}" y="{y + row_h / 2:.1f}" dy="3.5" text-anchor="end">'
                        f'{escape(name)}</text>')
        fills = [color(v) if finite(v) else "" for v in values]
        start = 0
        for i in range(1, len(values) + 1):
            if i < len(values) and fills[i] == fills[start]:
                continue
            if fills[start]:
                run = [v for v in values[start:i] if finite(v)]
                x0, x1 = frame.x(edges[start]), frame.x(edges[i])
                tip = describe(r, edges[start], edges[i], min(run), max(run)) if describe else ""
                body.append(f'<rect class="cell" x="{x0:.1f}" y="{y:.1f}" width="{x1 - x0:.2f}" height="{row_h:.2f}" '
                            f'fill="{fills[start]}"><title>{escape(tip)}</title></rect>')
            start = i
    bottom = frame.y0 + n * row_h
    for v in ticks(*frame.xd, n=max(2, int((frame.x1 - frame.x0) / 110))):
        x = f"{frame.x(v):.1f}"
        body.append(f'<line x1="{x}" x2="{x}" y1="{bottom}" y2="{bottom + 4}" stroke="#9ca3af"/>'
                    f'<text x="{x}" y="{bottom + 15}" text-anchor="middle">{escape(fmt_num(v))}</text>')
    return _svg(frame, body, label)
