"""The components that watch a step from outside its math: the watchdog's sections and phases, the
evaluation, the step's end mark."""

from __future__ import annotations

from collections.abc import Callable

from keel.core.callbacks import Step
from keel.health.watchdog import Watchdog
from keel.monitor.run_monitor import RunMonitor
from keel.train.components import Builtin


class WatchdogSections(Builtin):
    """Each step is a watchdog section: a rank that does not finish it in time is a hang."""
    priority = 100

    def __init__(self, watchdog: Watchdog) -> None:
        self.watchdog = watchdog

    def on_step_start(self, step: Step) -> None:
        self.watchdog.begin("step", step.number)

    def on_step_end(self, step: Step) -> None:
        self.watchdog.end()


class WatchdogPhases(Builtin):
    """Where in the step each rank is, for the hang report: registered after the configured callbacks,
    so that a fault they deliver lands in the phase it was meant for."""
    priority = -10  # after the configured callbacks (priority 0)

    def __init__(self, watchdog: Watchdog) -> None:
        self.watchdog = watchdog

    def on_batch(self, step: Step) -> None:
        self.watchdog.phase("forward_backward")

    def on_backward(self, step: Step, replaying: bool) -> None:
        if not replaying:
            self.watchdog.phase("reduce")  # from here on a rank waits for the others in collectives

    def after_backward(self, step: Step) -> None:
        self.watchdog.phase("update")


class Evaluation(Builtin):
    """Every `eval.interval` steps (registered with that frequency) and, with `eval.final`, at the last:
    the validation loss and bits per byte."""
    priority = 90

    def __init__(self, evaluate: Callable[[], float], bpb: Callable[[float], float], watchdog: Watchdog,
                 monitor: RunMonitor, notify: Callable[..., None], say: Callable[[str], None], interval: int,
                 final: bool) -> None:
        self.evaluate, self.bpb, self.watchdog, self.monitor = evaluate, bpb, watchdog, monitor
        self.notify, self.say, self.interval, self.final = notify, say, interval, final
        self.val_loss = float("nan")

    def on_step_end(self, step: Step) -> None:
        state = step.state
        if not (self.final or self.interval and state.step % self.interval == 0):
            return  # the last step, called whatever the frequency
        self.watchdog.begin("eval", state.step)
        with self.monitor.phase("evaluation", whole_step=False):
            self.val_loss = self.evaluate()
        self.watchdog.end()
        val_bpb = self.bpb(self.val_loss)
        self.monitor.publish({"step": state.step, "val/loss": self.val_loss, "val/bpb": val_bpb})
        step.metrics.update({"val/loss": self.val_loss, "val/bpb": val_bpb})
        self.say(f"step {state.step}: validation loss {self.val_loss:.4f} ({val_bpb:.4f} bits per byte)")
        self.notify("on_eval", state, self.val_loss)


class StepEnd(Builtin):
    """The step's time is the run's productive time; the first step of a start ends its recovery."""
    priority = -20  # last: the step's end mark

    def __init__(self, monitor: RunMonitor, emit: Callable[..., None], rank0: bool) -> None:
        self.monitor, self.emit, self.rank0 = monitor, emit, rank0
        self.first = True

    def on_step_end(self, step: Step) -> None:
        self.monitor.ledger.spent("productive")
        if self.first and self.rank0:  # the start's first step is done: recovery ends here
            self.emit("step", step.state.step, "first")
        self.first = False
