"""A callback that fails the way a bug in keel would: an exception out of a hook, on every rank."""

from __future__ import annotations

from keel.core.callbacks import Callback, Step


class RaiseAtStep(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, step: Step) -> None:
        if step.state.step == self.step:
            raise RuntimeError(f"raised by crash_probe at step {self.step}")
