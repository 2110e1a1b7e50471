"""Callbacks: how guards, health checks, monitors, fault injectors and users' code attach to the loop.

The loop calls each hook of every callback in a fixed order and never knows which callbacks exist.
A callback that keeps state implements `state_dict`/`load_state_dict` and is checkpointed with the run.
A callback with an `inspect(report) -> Action | None` method is also a guard (see keel.guard.engine).
"""

from __future__ import annotations

from typing import Any


class Callback:
    def on_build(self, parts: list[Any], optimizers: list[Any]) -> None: ...  # the model parts and optimizers
    def on_start(self, state: Any) -> None: ...
    # The step's micro-batches and their global batch number, before the forward pass.
    def on_step_start(self, state: Any, micro_batches: list[Any], batch: int) -> None: ...
    # Gradients exist, the update has not happened. Called again after a replay's recomputation.
    def after_backward(self, state: Any, replaying: bool) -> None: ...
    def on_step_end(self, state: Any, report: dict) -> None: ...
    def on_checkpoint_saved(self, state: Any, path: str) -> None: ...
    def on_checkpoint_failed(self, state: Any, step: int, error: str) -> None: ...
    # Runs on the checkpoint writer thread, after this rank wrote its files and before the commit.
    def on_checkpoint_write(self, step: int, staging_path: str) -> None: ...
    def on_checkpoint_loaded(self, state: Any, path: str) -> None: ...
    def on_eval(self, state: Any, val_loss: float) -> None: ...
    def on_end(self, state: Any) -> None: ...


class Callbacks:
    def __init__(self, callbacks: list[Callback]) -> None:
        self.callbacks = callbacks

    def __getattr__(self, hook: str):
        if not hook.startswith(("on_", "after_")):
            raise AttributeError(hook)

        def call(*args: Any) -> None:
            for cb in self.callbacks:
                getattr(cb, hook)(*args)
        return call

    def state_dict(self) -> dict:
        return {f"{i}:{type(cb).__name__}": cb.state_dict() for i, cb in enumerate(self.callbacks)
                if hasattr(cb, "state_dict")}

    def guards(self) -> list[Callback]:
        """The callbacks that are also guards."""
        return [cb for cb in self.callbacks if hasattr(cb, "inspect")]

    def load_state_dict(self, state: dict) -> None:
        for i, cb in enumerate(self.callbacks):
            key = f"{i}:{type(cb).__name__}"
            if hasattr(cb, "load_state_dict") and key in state:
                cb.load_state_dict(state[key])
