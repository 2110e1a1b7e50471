"""A sweep's grid: `--grid KEY=LO..HI:N` (N log-spaced values, ends included) or `--grid KEY=A,B,C`, each point
one combination of every axis's values, checked as a whole config before any point trains."""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from keel.config import Config, load_config
from keel.errors import ConfigError

RESERVED = ("train.steps",)  # set by --steps: the same for every point, so the points compare


@dataclass(frozen=True)
class Axis:
    key: str
    values: tuple[str, ...]  # as override text, so that every point's config reads them as the user meant


@dataclass(frozen=True)
class Point:
    index: int
    settings: tuple[tuple[str, str], ...]  # (key, value) per axis, in axis order

    @property
    def overrides(self) -> list[str]:
        return [f"{key}={value}" for key, value in self.settings]

    @property
    def name(self) -> str:
        """The point's run directory: its index, then each axis's last key part and value."""
        parts = [f"{key.rsplit('.', 1)[-1]}{re.sub(r'[^A-Za-z0-9.+-]', '_', value)}" for key, value in self.settings]
        return "-".join([f"{self.index:03d}", *parts])


def _number(text: str, spec: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ConfigError(f"--grid {spec!r}: {text!r} is not a number; a range is LO..HI:N, e.g. "
                          f"optim.lr=1e-4..3e-2:8") from None


def _range(lo_text: str, hi_text: str, n_text: str, spec: str) -> tuple[str, ...]:
    lo, hi = _number(lo_text, spec), _number(hi_text, spec)
    if not n_text.isdigit() or int(n_text) < 1:
        raise ConfigError(f"--grid {spec!r}: the count after ':' must be a positive integer, e.g. 1e-4..3e-2:8")
    n = int(n_text)
    if not (0 < lo <= hi) or not math.isfinite(hi) or (n == 1) != (lo == hi):
        raise ConfigError(f"--grid {spec!r}: a range is log-spaced and needs 0 < LO < HI (or LO = HI with :1)")
    ratios = [i / (n - 1) if n > 1 else 0.0 for i in range(n)]
    values = [lo * (hi / lo) ** r for r in ratios]
    integral = all(re.fullmatch(r"\d+", t) for t in (lo_text, hi_text))
    texts = tuple(str(round(v)) for v in values) if integral else tuple(f"{v:.3g}" for v in values)
    if len(set(texts)) < n:
        raise ConfigError(f"--grid {spec!r}: {n} log-spaced values between {lo_text} and {hi_text} repeat "
                          f"({', '.join(texts)}); ask for fewer")
    return texts


def parse_axis(spec: str) -> Axis:
    key, sep, body = spec.partition("=")
    key = key.strip()
    if not sep or not key or not body.strip():
        raise ConfigError(f"--grid {spec!r}: expected KEY=LO..HI:N or KEY=A,B,C, e.g. optim.lr=1e-4..3e-2:8")
    if key in RESERVED:
        raise ConfigError(f"--grid {spec!r}: {key} is set by --steps, the same for every point")
    if ".." in body:
        lo, _, rest = body.partition("..")
        hi, colon, n = rest.rpartition(":")
        if not colon:
            raise ConfigError(f"--grid {spec!r}: a range needs its count, LO..HI:N, e.g. optim.lr=1e-4..3e-2:8")
        return Axis(key, _range(lo.strip(), hi.strip(), n.strip(), spec))
    values = tuple(v.strip() for v in body.split(","))
    if any(not v for v in values):
        raise ConfigError(f"--grid {spec!r}: an empty value in the list; expected KEY=A,B,C")
    if len(set(values)) < len(values):
        raise ConfigError(f"--grid {spec!r}: a value is listed twice")
    return Axis(key, values)


def parse_grid(specs: Sequence[str], overrides: Sequence[str]) -> list[Axis]:
    if not specs:
        raise ConfigError("keel sweep needs at least one --grid KEY=LO..HI:N or KEY=A,B,C (or --coord-check)")
    axes = [parse_axis(spec) for spec in specs]
    keys = [a.key for a in axes]
    if dup := sorted({k for k in keys if keys.count(k) > 1}):
        raise ConfigError(f"--grid: {dup[0]} is given twice; give each key once, with all its values")
    fixed = {o.partition("=")[0].strip() for o in overrides}
    if clash := sorted(fixed & set(keys)):
        raise ConfigError(f"{clash[0]} is both an override and a --grid axis; keep one")
    return axes


def expand(axes: Sequence[Axis]) -> list[Point]:
    combos = itertools.product(*[[(a.key, v) for v in a.values] for a in axes])
    return [Point(i, tuple(combo)) for i, combo in enumerate(combos)]


def point_configs(config: str | None, overrides: Sequence[str], points: Sequence[Point]) -> list[Config]:
    """Every point's config, loaded as its run will load it: an unknown key or a value out of range fails here,
    naming the point, before any point trains."""
    configs = []
    for p in points:
        try:
            configs.append(load_config(config, [*overrides, *p.overrides]))
        except ConfigError as e:
            raise ConfigError(f"sweep point {', '.join(p.overrides)}: {e}") from None
    return configs
