"""The coordinate check of Tensor Programs V: train copies of a model at widths ×1, ×2, … of its base width for
a few steps, under the standard parametrization and under μP, and record the RMS of every layer's output at
each step. Under μP the curves across widths lie flat; under the standard one they grow with the width. It
runs in this process, on the CPU or the run's device, on fixed random token sequences (the scaling is a
property of the parametrization, not of the data).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from keel.config import Config, ModelConfig
from keel.errors import ConfigError
from keel.model.init import init_weights
from keel.model.llama import Llama, width_ratio
from keel.train.optim import build_optimizer
from keel.train.step import Stepper

PARAMETRIZATIONS = ("sp", "mup")


@dataclass
class CoordCheck:
    """rms[parametrization][multiplier][step - 1][layer]: the RMS of each layer's output in step `step`'s
    forward (after step - 1 updates); layers are the embedding, each block and the logits."""

    base_dim: int
    multipliers: list[int]
    steps: int
    layers: list[str]
    rms: dict[str, dict[int, list[list[float]]]] = field(default_factory=dict)

    def growth(self, parametrization: str, step: int) -> float:
        """The largest ratio, over the blocks, of the RMS at the widest model to that at the base width."""
        readings = self.rms[parametrization]
        wide, base = readings[self.multipliers[-1]][step - 1], readings[self.multipliers[0]][step - 1]
        blocks = [i for i, name in enumerate(self.layers) if name.startswith("block")]
        return max(wide[i] / base[i] for i in blocks)

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "growth": {p: [self.growth(p, s) for s in range(1, self.steps + 1)]
                                                       for p in self.rms}}


def parse_multipliers(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        values = []
    if len(values) < 2 or values != sorted(set(values)) or values[0] < 1:
        raise ConfigError(f"--widths {text!r}: expected at least two increasing width multipliers, e.g. 1,2,4,8")
    return values


def coord_check(cfg: Config, multipliers: list[int], steps: int, batch: int, device: torch.device,
                say: Callable[[str], None] = print) -> CoordCheck:
    """Train each width of each parametrization for `steps` steps at the config's peak learning rate
    (constant: no warm-up), from the config's seed, on the same token sequences."""
    base = cfg.model
    if steps < 1 or batch < 1:
        raise ConfigError(f"--steps {steps}, --batch {batch}: both must be at least 1")
    gen = torch.Generator().manual_seed(cfg.train.seed)
    tokens = torch.randint(0, base.vocab_size, (steps, batch, cfg.train.seq_len + 1), generator=gen).to(device)
    layers = ["embedding", *[f"block {i}" for i in range(base.n_layers)], "logits"]
    check = CoordCheck(base.dim, multipliers, steps, layers)
    for parametrization in PARAMETRIZATIONS:
        check.rms[parametrization] = {}
        for k in multipliers:
            model_cfg = dataclasses.replace(base, dim=base.dim * k, parametrization=parametrization,
                                            base_dim=base.dim if parametrization == "mup" else 0)
            check.rms[parametrization][k] = _train(cfg, model_cfg, tokens, device)
            say(f"{parametrization} ×{k} (dim {model_cfg.dim}): block RMS at step {steps} "
                f"{', '.join(f'{v:.3g}' for v in check.rms[parametrization][k][-1][1:-1])}")
    return check


def _train(cfg: Config, model_cfg: ModelConfig, tokens: torch.Tensor, device: torch.device) -> list[list[float]]:
    model = Llama(model_cfg).to(device)
    init_weights(model, cfg.train.seed)
    # The training step as the trainer makes it, without clipping: the raw updates are what is checked.
    stepper = Stepper([model], [build_optimizer(model, cfg.optim, width_ratio(model_cfg))], None, grad_clip=0.0,
                      autocast_dtype=None)
    # The model's own output is the logits, μP's output multiplier applied.
    modules = [m for m in (model.tok_embeddings, *model.layers.values(), model) if m is not None]
    seen: dict[int, float] = {}
    for i, module in enumerate(modules):
        module.register_forward_hook(lambda m, a, out, i=i: seen.__setitem__(i, _rms(out)))
    readings = []
    for batch in tokens:
        stepper.forward_backward([(batch[:, :-1], batch[:, 1:])])
        readings.append([seen[i] for i in range(len(modules))])
        stepper.update(cfg.optim.lr, stepper.grad_norm())
    return readings


def _rms(t: torch.Tensor) -> float:
    value = t.detach().float().square().mean().sqrt().item()
    return value if math.isfinite(value) else float("inf")
