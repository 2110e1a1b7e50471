"""The deploy examples start keel the way the README says and act on its exit codes."""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml

from keel.config import HealthConfig
from keel.errors import EXIT_BAD_INPUT, EXIT_GUARD_STOP, EXIT_PAUSED
from tests.conftest import REPO


def test_kubernetes_job_fails_on_stop_codes_and_retries_a_pause() -> None:
    service, job = yaml.safe_load_all((REPO / "deploy/k8s/keel-job.yaml").read_text())
    assert service["spec"]["clusterIP"] == "None"
    spec = job["spec"]
    rules = {r["action"]: r["onExitCodes"]["values"] for r in spec["podFailurePolicy"]["rules"] if "onExitCodes" in r}
    assert sorted(rules["FailJob"]) == [EXIT_BAD_INPUT, EXIT_GUARD_STOP]
    assert rules["Ignore"] == [EXIT_PAUSED]
    pod = spec["template"]["spec"]
    command = " ".join(pod["containers"][0]["args"])
    assert "--nnodes" in command and "--rdzv-endpoint keel-0.keel:29500" in command
    grace = int(command.split("health.shutdown_grace_s=")[1].split()[0])
    assert pod["terminationGracePeriodSeconds"] > grace
    assert pod["containers"][0]["env"][0]["name"] == "KEEL_NODE"


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
