"""The deploy examples start keel the way the README says and act on its exit codes."""

from __future__ import annotations

import subprocess

import yaml

from keel.errors import EXIT_BAD_INPUT, EXIT_GUARD_STOP, EXIT_PAUSED, EXIT_QUARANTINE
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


def test_slurm_script_parses_and_requeues_on_pause_and_quarantine() -> None:
    script = REPO / "deploy/slurm/keel.sbatch"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    text = script.read_text()
    assert f"  {EXIT_PAUSED})" in text and f"  {EXIT_QUARANTINE})" in text and "ExcNodeList" in text
    assert "KEEL_NODE=" in text and "--signal=B:TERM@" in text and "--rdzv-endpoint" in text
