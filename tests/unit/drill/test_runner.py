"""The drill's clean references: which runs count as the same one."""

from __future__ import annotations

from pathlib import Path

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
