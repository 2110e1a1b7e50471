"""The failure catalog: each scenario is a real fault, the promise recovery makes about it, and the clean
run its outcome must match."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

BITWISE = "bitwise"  # the final state equals the clean run's, bit for bit
REFERENCE_WITH = "reference_with"  # the final state equals a clean run told to do what the guard did


@dataclass(frozen=True)
class Outside:
    """An action taken from outside the job: `signal` sent to the launcher once the run reached `at_step`."""

    signal: str = "SIGTERM"
    at_step: int = 0


@dataclass(frozen=True)
class Scenario:
    """One rehearsed failure.

    `config` holds overrides that shape the math (layout, guard settings): the clean reference runs with
    them too. `tuning` holds overrides that only make the detectors act within a short run (watchdog
    timeouts, check intervals): the faulted run alone gets them, so they must not change the math.
    """

    name: str
    promise: str
    inject: tuple[str, ...] = ()
    fault_step: int = 0  # the step the fault lands in (detection latency counts from here)
    config: tuple[str, ...] = ()
    tuning: tuple[str, ...] = ()
    max_restarts: int = 0
    outside: Outside | None = None
    rerun: bool = False  # after the first launch ends, run the same command again without the fault
    first_exit: int | None = None  # the exit code the first launch must end with when `rerun` (None: non-zero)
    compare: str = BITWISE
    reference_with: tuple[str, ...] = ()  # REFERENCE_WITH: overrides of the clean run to compare with
    detect: tuple[str, str] = ("", "")  # (kind, action) of the event that counts as detection; "" matches any
    recovered_by: tuple[str, str] | None = ("step", "first")  # the event that ends recovery; None: immediate
    steps: int | None = None  # the run's length, when the scenario needs another than the suite's
    requires: str = ""  # the machinery still missing to rehearse it; such a scenario is listed, not run

    def with_(self, **changes: object) -> Scenario:
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class Plan:
    """Where faults land in a run of `steps` steps with a checkpoint every `interval` steps."""

    steps: int = 40
    interval: int = 10
    rank: int = 1

    @property
    def mid(self) -> int:
        """A step in the middle of the last full checkpoint interval but one: work is lost on a restart."""
        return self.steps - self.interval - self.interval // 2

    @property
    def save(self) -> int:
        """A checkpoint step with an earlier checkpoint to fall back to (the last one but the final)."""
        return self.steps - self.interval


# The spike guard needs a warm window before a poisoned batch stands out; these match the guard tests.
SPIKE_GUARDS = ("guard.snapshot_interval=10", "guard.rollback_steps=5", "guard.skip_batches=8",
                "guard.spike.warmup=20", "guard.spike.window=40")
FAST_WATCHDOG = ("health.watchdog.warmup_steps=5", "health.watchdog.min_timeout_s=4", "health.watchdog.poll_s=0.5")
REPLICATED = ("parallel.dp_replicate=2", "parallel.dp_shard=1")


def _poisoned(steps: int = 80, snapshot: int = 10, rollback: int = 5, skip: int = 8) -> Scenario:
    batch = steps * 5 // 8 - 1  # read by step batch + 1, after the spike window has warmed up
    to_step = (batch + 1 - rollback) // snapshot * snapshot  # the newest snapshot far enough back
    skipped = [to_step, max(to_step + skip, batch + 1)]
    return Scenario(
        "poisoned_batch", "a loss spike rolls back and skips the bad data; the result is the clean run without it",
        inject=(f"poison_batch:batch={batch}",), fault_step=batch + 1, config=SPIKE_GUARDS, compare=REFERENCE_WITH,
        reference_with=(f"data.skip_batches=[{skipped}]",), detect=("guard", "rollback"),
        recovered_by=("guard", "rolled_back"), steps=steps)


def catalog(plan: Plan = Plan()) -> dict[str, Scenario]:
    """Every scenario, keyed by name, with its faults placed for `plan`."""
    mid, save, r = plan.mid, plan.save, plan.rank
    scenarios = [
        Scenario("kill_mid_step", "a rank SIGKILLed mid-step is restarted and the run ends bitwise equal",
                 inject=(f"kill:step={mid},rank={r}",), fault_step=mid, max_restarts=1, detect=("failure", "")),
        Scenario("kill_during_save", "a SIGKILL during a background checkpoint write loses no committed state; "
                 "the rerun resumes from the previous checkpoint and ends bitwise equal",
                 inject=(f"sigkill_during_checkpoint_write:step={save},rank={r}",), fault_step=save, rerun=True,
                 detect=("failure", "")),
        Scenario("hang", "a hung rank is found within the learned timeout, restarted, and the run ends bitwise equal",
                 inject=(f"hang:step={mid},rank={r}",), fault_step=mid, tuning=FAST_WATCHDOG, max_restarts=1,
                 detect=("hang", "")),
        Scenario("straggler", "a rank 3x slower is named and the math is untouched",
                 inject=(f"slow:rank={r},factor=3",), fault_step=1,
                 tuning=(f"health.straggler.interval={max(plan.interval // 2, 5)}",),
                 detect=("straggler", ""), recovered_by=None),
        Scenario("nan_grads", "a NaN in one rank's gradients skips that update on every rank and nothing else",
                 inject=(f"nan_grads:step={mid},rank={r}",), fault_step=mid, compare=REFERENCE_WITH,
                 reference_with=(f'drill.inject=["skip_update:step={mid}"]',), detect=("guard", "skip"),
                 recovered_by=None),
        _poisoned(),
        Scenario("bitflip_params_replicated", "a flipped bit in one replica's parameters is caught by fingerprints, "
                 "rolled back and re-executed; the run ends bitwise equal",
                 inject=(f"bitflip:step={mid},rank={r},target=params,tensor=3,element=5,bit=22",), fault_step=mid,
                 config=REPLICATED, tuning=(f"guard.sdc.fingerprint_interval={plan.interval}",),
                 detect=("guard", "rollback"), recovered_by=("guard", "rolled_back")),
        Scenario("bitflip_grads", "a flipped bit in one rank's gradients is caught by replay in its step and the "
                 "run ends bitwise equal",
                 inject=(f"bitflip:step={mid},rank={r},target=grads,tensor=3,element=5,bit=3",), fault_step=mid,
                 tuning=(f"guard.sdc.replay_interval={plan.interval // 2}",),
                 detect=("guard", "quarantine"), recovered_by=("guard", "rolled_back")),
        Scenario("bitflip_optimizer", "a flipped exponent bit in one replica's Adam moment is caught and rolled back; "
                 "the run ends bitwise equal",
                 inject=(f"bitflip:step={mid},rank={r},target=exp_avg,tensor=2,element=0,bit=30",), fault_step=mid,
                 config=REPLICATED, tuning=(f"guard.sdc.fingerprint_interval={plan.interval}",),
                 detect=("guard", ""), recovered_by=("guard", "rolled_back")),
        Scenario("preemption", "SIGTERM to the launcher checkpoints, exits 75, and the rerun ends bitwise equal",
                 inject=("slow:rank=-1,seconds=0.1",), outside=Outside("SIGTERM", at_step=plan.interval),
                 fault_step=plan.interval, rerun=True, first_exit=75, detect=("pause", "")),
        Scenario("corrupt_checkpoint", "a corrupted latest checkpoint is skipped on resume; the run resumes from the "
                 "previous one and ends bitwise equal", fault_step=save, detect=("checkpoint", "skipped"),
                 requires="an outside action that corrupts the newest checkpoint between a pause and the rerun"),
        Scenario("disk_full", "ENOSPC during a save loses nothing, the next save succeeds, the run ends bitwise equal",
                 fault_step=save, detect=("checkpoint", "failed"), recovered_by=("checkpoint", "committed"),
                 requires=f"a small volume for checkpoint.dir (a tmpfs mount, which needs privileges) to fill with "
                          f"fill_disk_before_checkpoint:path=VOLUME,step={save}"),
        Scenario("node_loss", "a node that leaves an elastic job is dropped; the rest resume from its checkpoint "
                 "with the same global batch and data order", detect=("leave", ""),
                 requires="two local launchers (--nnodes 1:2) and a comparison that is numerically close, "
                          "not bitwise, across world sizes"),
        Scenario("slow_collective", "a delayed collective slows steps without changing the math and is reported",
                 requires="an injector that delays a collective (slow only delays compute, outside collectives)"),
    ]
    return {s.name: s for s in scenarios}


def runnable(scenarios: dict[str, Scenario]) -> dict[str, Scenario]:
    return {name: s for name, s in scenarios.items() if not s.requires}


# The scenarios of the quick suite: a minute or two of a small run each.
QUICK = ["kill_mid_step", "kill_during_save", "hang", "nan_grads", "bitflip_grads", "preemption"]
