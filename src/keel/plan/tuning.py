"""`keel plan --sweep DIR`: what a finished `keel sweep` says of the planned model. The learning rate from the
sweep's transfer line at the planned width, the warmup as the same share of the run as in the sweep, and the loss
of the power law fitted over the sweep's sizes at the planned size: an extrapolation in parameters, at the
sweep's own (small) token count per point, and said to be one."""

from __future__ import annotations

import json
from pathlib import Path

from keel.config import Config
from keel.config.load import parse_override
from keel.errors import KeelError
from keel.sweep.analysis import PowerLaw, recommend

MIN_SIZES = 3  # a two-parameter law through two sizes fits exactly: no residual would say how well


def read_sweep(path: Path) -> dict:
    try:
        result = json.loads((path / "sweep.json").read_text())
    except FileNotFoundError:
        raise KeelError(f"--sweep {str(path)!r}: no sweep.json there; pass the --out directory of a finished "
                        f"keel sweep") from None
    except (OSError, ValueError) as e:
        raise KeelError(f"--sweep {str(path)!r}: sweep.json cannot be read ({e}); rerun the keel sweep to "
                        f"rewrite it") from None
    if not isinstance(result, dict) or not isinstance(result.get("series"), list):
        raise KeelError(f"--sweep {str(path)!r}: sweep.json is not a keel sweep's result")
    return result


def _setting_matches(cfg: Config, key: str, text: str) -> bool:
    node: object = cfg
    for part in key.split("."):
        node = getattr(node, part, None)
    return node == parse_override(f"{key}={text}")[1]


def _series_for(result: dict, cfg: Config, where: Path) -> dict:
    """The series whose fixed axes the planned config shares, under its parametrization and base width: the
    learning rate of another parametrization would not transfer."""
    matching = [s for s in result["series"] if all(_setting_matches(cfg, k, v) for k, v in s["settings"].items())]
    if not matching:
        groups = "; ".join(s["group"] for s in result["series"]) or "none finished"
        raise KeelError(f"--sweep {str(where)!r}: no series of the sweep matches the planned config (series: "
                        f"{groups}); plan a config with one series' settings")
    series = matching[0]
    if (series["parametrization"], series["base_dim"]) != (cfg.model.parametrization, cfg.model.base_dim):
        raise KeelError(f"--sweep {str(where)!r}: the sweep ran model.parametrization = {series['parametrization']} "
                        f"with model.base_dim = {series['base_dim']}, the planned config "
                        f"{cfg.model.parametrization} with {cfg.model.base_dim}; its learning rate transfers only "
                        f"under the same")
    return series


def from_sweep(path: Path, cfg: Config, params: int, steps: int) -> dict:
    """The `tuning` section of `keel plan`'s answer."""
    result = read_sweep(path)
    series = _series_for(result, cfg, path)
    lr = recommend(series, cfg.model.dim)
    if lr is None:
        raise KeelError(f"--sweep {str(path)!r}: every point of series {series['group'] or 'all'} diverged; there "
                        f"is no optimum to transfer")
    widths = [w["width"] for w in series["widths"]]
    share = series["warmup_steps"] / result["steps"]
    out: dict = {"sweep": str(path), "series": series["group"], "complete": result["complete"], "width": cfg.model.dim,
                 "lr": lr, "swept_widths": widths, "transfer": series["transfer"],
                 "optimum_at_edge": [w["width"] for w in series["widths"] if w["optimum_at_edge"]],
                 "depth": {"swept": series["n_layers"], "planned": cfg.model.n_layers},
                 "warmup_share": share, "warmup_steps": round(share * steps), "expected_loss": None}
    if (law := series["power_law"]) and len(law["points"]) >= MIN_SIZES:
        fit = PowerLaw(law["coefficient"], law["exponent"], tuple((int(n), v) for n, v in law["points"]))
        largest = max(n for n, _ in fit.points)
        out["expected_loss"] = {"loss": fit(params), "params": params, "beyond_largest": params / largest,
                                "tokens_per_point": series["tokens"], "fit": law}
    return out


def tuning_lines(t: dict) -> list[str]:
    tr = t["transfer"]
    where = f"widths {', '.join(map(str, t['swept_widths']))}"
    evidence = (f"the optimum moved {tr['drift']:.2f}× across {where}; lr* ∝ width^{tr['slope']:.2f}"
                if tr["slope"] is not None else f"one width swept ({where}): its optimum, untransferred")
    series = f", series {t['series']}" if t["series"] else ""
    unfinished = "" if t["complete"] else " (not finished: its finished points only)"
    out = [f"from sweep {t['sweep']}{unfinished}{series}:",
           f"  learning rate {t['lr']:.3g} at width {t['width']} ({evidence})",
           f"  warmup {t['warmup_steps']:,} steps ({t['warmup_share']:.1%} of the run, the sweep's share)"]
    if t["optimum_at_edge"]:
        out.append(f"  warning: the optimum lies at an end of the learning-rate grid at width(s) "
                   f"{', '.join(map(str, t['optimum_at_edge']))}: widen the grid and sweep again")
    if t["depth"]["swept"] != t["depth"]["planned"]:
        out.append(f"  note: the sweep's models have {t['depth']['swept']} layers, the planned one "
                   f"{t['depth']['planned']}: the learning rate transfers across width, not depth")
    if e := t["expected_loss"]:
        fit = e["fit"]
        residuals = ", ".join(f"{r:+.3f}" for r in fit["residuals"])
        out.append(f"  expected loss {e['loss']:.3f}: EXTRAPOLATION {e['beyond_largest']:,.0f}× beyond the largest "
                   f"swept model, of loss = {fit['coefficient']:.3g} · params^{-fit['exponent']:.3f} fitted on "
                   f"{len(fit['points'])} sizes at {e['tokens_per_point'] / 1e6:.3g}M tokens each (residuals "
                   f"{residuals}); the planned token budget is not in the fit")
    else:
        out.append(f"  no expected loss: the power law needs the best loss of {MIN_SIZES} or more swept widths")
    return out
