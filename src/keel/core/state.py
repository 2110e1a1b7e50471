"""TrainState: every host-side value that shapes the rest of the run. Model and optimizer tensors,
and each rank's RNG, are checkpointed beside it."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import ClassVar, Protocol, runtime_checkable

import numpy as np
import torch


class Stateful(Protocol):
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...


@runtime_checkable
class NamedState(Protocol):
    """A component that keeps a part of the host train state of its own, under `state_name`."""

    state_name: str

    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...


@dataclass
class TrainState:
    """The run's counters, and the components whose state is saved with them: each registered once by
    name (`register`), so that a checkpoint, a snapshot and a resume all go through the same list."""

    step: int = 0  # optimizer updates done; the LR schedule is a function of it
    tokens_seen: int = 0
    train_seconds: float = 0.0  # wall time spent training, summed over restarts
    interruptions: int = 0  # times the run was resumed: the observed failure rate for the checkpoint interval
    stateful: dict[str, Stateful] = field(default_factory=dict, repr=False, compare=False)
    record: dict = field(default_factory=dict, repr=False, compare=False)  # what `from_dict` read
    COUNTERS: ClassVar[tuple[str, ...]] = ("step", "tokens_seen", "train_seconds", "interruptions")

    def register(self, name: str, component: Stateful) -> None:
        if name in self.stateful or name in self.COUNTERS:
            raise ValueError(f"train state {name!r} is registered twice")
        self.stateful[name] = component

    def to_dict(self) -> dict:
        """The counters and every registered component's state, as the checkpoint's manifest records them."""
        return {**{name: getattr(self, name) for name in self.COUNTERS},
                **{name: component.state_dict() for name, component in self.stateful.items()}}

    @classmethod
    def from_dict(cls, data: dict) -> TrainState:
        """The counters of a saved state; the whole record is kept for `load` into the live one."""
        return cls(**{name: data[name] for name in cls.COUNTERS if name in data}, record=data)

    def load(self, data: dict, only: tuple[str, ...] | None = None) -> None:
        """Put back the counters and the registered components' states of `data` (those named in `only`,
        when given: a rollback keeps what counts restarts and suspects)."""
        for name in self.COUNTERS:
            if name in data:
                setattr(self, name, data[name])
        for name, component in self.stateful.items():
            if name in data and (only is None or name in only):
                component.load_state_dict(data[name])


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
