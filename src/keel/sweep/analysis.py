"""What a sweep's points say together. The points are grouped into series (every axis but the learning rate and
the width held fixed, e.g. one series per parametrization); within a series, per width, the loss against the
learning rate gives the optimum and Wortsman et al.'s LR sensitivity; across widths, the optimum's drift gives
the transferred learning rate; the best loss per size gives a power law in parameters."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

LR_KEY = "optim.lr"
WIDTH_KEY = "model.dim"
AXES = (LR_KEY, WIDTH_KEY)  # the axes within a series; every other axis tells series apart
SERIES_FIELDS = ("parametrization", "base_dim", "n_layers", "warmup_steps", "tokens")  # what a series' points share


def sensitivity(losses: Sequence[float | None], initial: float) -> float:
    """Wortsman et al.'s LR sensitivity, E_lr[min(L(lr), L0)] - min_lr min(L(lr), L0), over the grid's learning
    rates: L0 the loss at initialisation, a diverged run (None) counted as L0."""
    clipped = [initial if v is None else min(v, initial) for v in losses]
    return statistics.fmean(clipped) - min(clipped)


def optimum(lrs: Sequence[float], losses: Sequence[float | None]) -> tuple[float, bool] | None:
    """The learning rate of least loss, refined by the parabola through it and its two neighbours in log(lr)
    (kept between them); and whether it lies at an end of the grid (then the grid should be widened). None when
    every run diverged."""
    finite = [(i, v) for i, v in enumerate(losses) if v is not None]
    if not finite:
        return None
    best, _ = min(finite, key=lambda item: item[1])
    edge = best in (0, len(lrs) - 1)
    if edge or losses[best - 1] is None or losses[best + 1] is None:
        return lrs[best], edge
    x0, x1, x2 = (math.log(lrs[i]) for i in (best - 1, best, best + 1))
    y0, y1, y2 = (v for i in (best - 1, best, best + 1) if (v := losses[i]) is not None)
    denom = (x0 - x1) * (x0 - x2) * (x1 - x2)
    a = (x2 * (y1 - y0) + x1 * (y0 - y2) + x0 * (y2 - y1)) / denom
    b = (x2 * x2 * (y0 - y1) + x1 * x1 * (y2 - y0) + x0 * x0 * (y1 - y2)) / denom
    if a <= 0:
        return lrs[best], False
    return math.exp(min(max(-b / (2 * a), x0), x2)), False


def line_fit(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least squares y = a + b x."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx > 0 else 0.0
    return my - b * mx, b


@dataclass(frozen=True)
class PowerLaw:
    """loss = coefficient * params ** -exponent, fitted in log-log space over the sweep's sizes."""

    coefficient: float
    exponent: float
    points: tuple[tuple[int, float], ...]  # (params, best loss) it was fitted on

    def __call__(self, params: float) -> float:
        return self.coefficient * params ** -self.exponent

    @property
    def residuals(self) -> list[float]:
        """Measured minus fitted loss, per size."""
        return [loss - self(n) for n, loss in self.points]

    def to_json(self) -> dict:
        return {"coefficient": self.coefficient, "exponent": self.exponent,
                "points": [list(p) for p in self.points], "residuals": self.residuals}


def power_law(points: Sequence[tuple[int, float]]) -> PowerLaw | None:
    """None below two sizes: a line through one point says nothing."""
    if len({n for n, _ in points}) < 2:
        return None
    a, b = line_fit([math.log(n) for n, _ in points], [math.log(v) for _, v in points])
    return PowerLaw(math.exp(a), -b, tuple(sorted(points)))


def _width_summary(runs: list[dict]) -> dict:
    runs = sorted(runs, key=lambda r: r["lr"])
    lrs, losses = [r["lr"] for r in runs], [None if r["diverged"] else r["loss"] for r in runs]
    found = optimum(lrs, losses)
    best = min((v for v in losses if v is not None), default=None)
    return {"width": runs[0]["width"], "params": runs[0]["params"], "lrs": lrs, "losses": losses,
            "optimum_lr": found[0] if found else None, "optimum_at_edge": found[1] if found else None,
            "best_loss": best, "sensitivity": sensitivity(losses, runs[0]["initial_loss"])}


def transfer(widths: list[dict], grid_ratio: float) -> dict:
    """The optimum's drift across widths, and the line log(lr*) = a + b log(width) through the optima: the
    slope b is 0 where the learning rate transfers (μP), about -1 under the standard parametrization with Adam."""
    found = [(w["width"], w["optimum_lr"]) for w in widths if w["optimum_lr"] is not None]
    if not found:
        return {"widths": [], "drift": None, "grid_steps": None, "slope": None, "intercept": None}
    a, b = line_fit([math.log(w) for w, _ in found], [math.log(lr) for _, lr in found])
    drift = max(lr for _, lr in found) / min(lr for _, lr in found)
    steps = math.log(drift) / math.log(grid_ratio) if grid_ratio > 1 else 0.0
    return {"widths": [w for w, _ in found], "drift": drift, "grid_steps": steps,
            "slope": b if len(found) > 1 else None, "intercept": a if len(found) > 1 else None}


def recommend(series: dict, width: int) -> float | None:
    """The learning rate for `width` from a series' transfer line; from its single width's optimum when it
    swept one width."""
    t = series["transfer"]
    if t["slope"] is None:
        return next((w["optimum_lr"] for w in series["widths"] if w["optimum_lr"] is not None), None)
    return math.exp(t["intercept"] + t["slope"] * math.log(width))


def summarize(points: list[dict]) -> list[dict]:
    """The series of a sweep's finished points, each with its per-width summaries, transfer and power law.
    Points carry `group` and `settings` (every axis's), `width`, `lr`, `loss`, `diverged`, `params`,
    `initial_loss` and the SERIES_FIELDS."""
    groups: dict[str, list[dict]] = {}
    for p in points:
        groups.setdefault(p["group"], []).append(p)
    out = []
    for group, runs in groups.items():
        by_width: dict[int, list[dict]] = {}
        for r in runs:
            by_width.setdefault(r["width"], []).append(r)
        widths = [_width_summary(by_width[w]) for w in sorted(by_width)]
        lrs = sorted({r["lr"] for r in runs})
        ratio = min((b / a for a, b in zip(lrs, lrs[1:], strict=False)), default=1.0)
        law = power_law([(w["params"], w["best_loss"]) for w in widths if w["best_loss"] is not None])
        first = runs[0]
        out.append({"group": group, "settings": {k: v for k, v in first["settings"].items() if k not in AXES},
                    **{k: first[k] for k in SERIES_FIELDS}, "widths": widths,
                    "transfer": transfer(widths, ratio), "power_law": law.to_json() if law else None})
    return out
