"""The deploy examples start keel the way the README says and act on its exit codes."""

from __future__ import annotations

import subprocess

from keel.errors import EXIT_PAUSED, EXIT_QUARANTINE
from tests.conftest import REPO


def test_slurm_script_parses_and_requeues_on_pause_and_quarantine() -> None:
    script = REPO / "deploy/slurm/keel.sbatch"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    text = script.read_text()
    assert f"  {EXIT_PAUSED})" in text and f"  {EXIT_QUARANTINE})" in text and "ExcNodeList" in text
    assert "KEEL_NODE=" in text and "--signal=B:TERM@" in text and "--rdzv-endpoint" in text
