"""The drill's clean references: which runs count as the same one."""

from __future__ import annotations

from pathlib import Path

import pytest

from keel.drill.runner import Drill
from keel.drill.scenarios import FAST_WATCHDOG


def test_a_reference_differs_by_what_the_run_computes_not_by_when_a_detector_looks(tmp_path: Path) -> None:
    drill = Drill(tmp_path)
    clean = drill.reference_key(drill.base(30))
    looks_elsewhen = [*drill.base(30), "guard.sdc.replay_interval=0", "guard.sdc.fingerprint_interval=3",
                      *FAST_WATCHDOG]
    assert drill.reference_key(looks_elsewhen) == clean
    assert drill.reference_key([*drill.base(30), "optim.lr=1e-3"]) != clean
    assert drill.reference_key(drill.base(40)) != clean
    assert drill.reference_key(drill.base(30), groups=2) != clean


def test_a_scenario_on_processes_of_its_own_has_a_reference_of_its_own(tmp_path: Path) -> None:
    """A layout that names its number of processes (2 HSDP replicas of 2 expert ranks: 4) is cleanly run on as
    many; the drill's own number named again is the drill's reference."""
    drill = Drill(tmp_path)  # --nproc 2
    clean = drill.reference_key(drill.base(30))
    assert drill.reference_key(drill.base(30), nproc=2) == clean
    assert drill.reference_key(drill.base(30), nproc=4) != clean
    groups = drill.reference_key(drill.base(30), groups=2)
    assert drill.reference_key(drill.base(30), groups=2, nproc=1) == groups
    assert drill.reference_key(drill.base(30), groups=2, nproc=2) not in (groups, clean)


@pytest.mark.parametrize("nproc, groups, procs", [(0, 1, 2), (4, 1, 4), (0, 2, 1), (2, 2, 2)])
def test_a_launch_runs_the_processes_its_scenario_names(tmp_path: Path, nproc: int, groups: int,
                                                        procs: int) -> None:
    """The drill's --nproc (2 here) unless the scenario names a number; replica groups of one process each
    unless it names more."""
    args = Drill(tmp_path).train_args(tmp_path / "run", [], nproc=nproc, groups=groups)
    assert args[args.index("--nproc") + 1] == str(procs)
    assert (args[args.index("--replica-groups") + 1] if "--replica-groups" in args else None) == \
        (str(groups) if groups > 1 else None)
