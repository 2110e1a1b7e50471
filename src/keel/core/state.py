"""TrainState: every host-side value that shapes the rest of the run. Model and optimizer tensors,
and each rank's RNG, are checkpointed beside it."""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class TrainState:
    step: int = 0  # optimizer updates done; the LR schedule is a function of it
    tokens_seen: int = 0
    loader: dict = field(default_factory=dict)  # GlobalOrderLoader.state_dict()
    callbacks: dict = field(default_factory=dict)  # name → state of each stateful callback
    train_seconds: float = 0.0  # wall time spent training, summed over restarts
    interruptions: int = 0  # times the run was resumed: the observed failure rate for the checkpoint interval
    guards: dict = field(default_factory=dict)  # guard histories and counters (keel.guard.engine.Guards.state_dict)
    health: dict = field(default_factory=dict)  # learned watchdog timeouts (keel.health.watchdog.Watchdog.state_dict)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> TrainState:
        return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls) if f.name in data})


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def seed_everything(seed: int, rank: int, step: int = 0) -> None:
    """Distinct, reproducible streams per rank (for dropout-like randomness; init does not use them).
    A run resumed in another layout re-derives them from (seed, step, rank)."""
    mixed = ((seed * 100_003 + rank) + step * 1_000_003) % 2**64  # torch.manual_seed's range
    torch.manual_seed(mixed)
    np.random.seed(mixed % 2**32)
    random.seed(mixed)
