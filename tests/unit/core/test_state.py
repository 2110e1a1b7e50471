"""The train state: its counters and every registered component's state, saved and put back together."""

from __future__ import annotations

import pytest

from keel.core.state import TrainState


class Cursor:
    def __init__(self, at: int = 0) -> None:
        self.at = at

    def state_dict(self) -> dict:
        return {"at": self.at}

    def load_state_dict(self, state: dict) -> None:
        self.at = state["at"]


def test_registered_components_are_saved_with_the_counters_and_loaded_back() -> None:
    state, loader, guards = TrainState(step=7, tokens_seen=70), Cursor(3), Cursor(9)
    state.register("loader", loader)
    state.register("guards", guards)
    saved = state.to_dict()
    assert saved == {"step": 7, "tokens_seen": 70, "train_seconds": 0.0, "interruptions": 0,
                     "loader": {"at": 3}, "guards": {"at": 9}}
    fresh, loader_2, guards_2 = TrainState(), Cursor(), Cursor()
    fresh.register("loader", loader_2)
    fresh.register("guards", guards_2)
    read = TrainState.from_dict(saved)
    assert (read.step, read.tokens_seen) == (7, 70) and read.record is saved
    fresh.load(read.record)
    assert (fresh.step, fresh.tokens_seen, loader_2.at, guards_2.at) == (7, 70, 3, 9)


def test_load_only_puts_back_the_components_named() -> None:
    state, loader, guards = TrainState(step=9), Cursor(5), Cursor(8)
    state.register("loader", loader)
    state.register("guards", guards)
    state.load({"step": 4, "loader": {"at": 1}, "guards": {"at": 2}}, only=("loader",))
    assert (state.step, loader.at, guards.at) == (4, 1, 8)


@pytest.mark.parametrize("name", ["loader", "step"])
def test_a_name_registered_twice_or_a_counter_is_refused(name: str) -> None:
    state = TrainState()
    state.register("loader", Cursor())
    with pytest.raises(ValueError, match=f"{name!r} is registered twice"):
        state.register(name, Cursor())
