"""The deploy examples start keel the way docs/deploy.md says and act on its exit codes."""

from __future__ import annotations

import subprocess
from pathlib import Path

from keel.config import HealthConfig
from tests.conftest import REPO


def sbatch_options(script: Path) -> dict[str, str]:
    """A batch script's #SBATCH options as sbatch reads them: those before its first command."""
    options = {}
    for line in script.read_text().splitlines()[1:]:
        if line.startswith("#SBATCH "):
            key, _, value = line.removeprefix("#SBATCH ").partition("=")
            options[key] = value
        elif line.strip() and not line.startswith("#"):
            break
    return options


# What the script does with a signal and each exit code runs on a real Slurm in tests/dist/test_slurm.py.
def test_slurm_script_warns_its_shell_before_the_launchers_grace_and_keeps_one_log() -> None:
    script = REPO / "deploy/slurm/keel.sbatch"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    options = sbatch_options(script)
    target, _, lead_s = options["--signal"].partition("@")
    assert target == "B:TERM"  # the batch shell, whose trap passes it on to the launchers
    assert int(lead_s) > HealthConfig().shutdown_grace_s
    assert "--requeue" in options and options["--open-mode"] == "append"  # every allocation adds to one log
