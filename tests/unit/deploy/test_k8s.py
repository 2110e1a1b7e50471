"""The Kubernetes example: its resources match each supported version's API schemas (offline, the
schemas that kubernetes-validate ships), its pod failure policy acts on keel's exit codes as
docs/deploy.md says, its image is the one the Dockerfile builds, and its first process passes a SIGTERM on to keel."""

from __future__ import annotations

import copy
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml
from kubernetes_validate import ValidationError, validate

from keel.errors import EXIT_BAD_INPUT, EXIT_GUARD_STOP, EXIT_HANG, EXIT_PAUSED, EXIT_QUARANTINE
from keel.rundir.status import read_status
from tests.conftest import REPO, SMALL_RUN, TAG, keel_env, kill_tagged, run_keel

SUPPORTED = [f"1.{minor}" for minor in range(31, 38)]  # docs/deploy.md, "Kubernetes"
MANIFEST = REPO / "deploy/k8s/keel-job.yaml"


def resources() -> dict[str, dict]:
    return {doc["kind"]: doc for doc in yaml.safe_load_all(MANIFEST.read_text())}


def validate_all(docs: list[dict], version: str) -> None:
    for doc in docs:
        validate(doc, version, strict=True)  # strict: a field the version does not know is an error


@pytest.mark.parametrize("version", SUPPORTED)
def test_every_resource_matches_the_kubernetes_schemas(version: str) -> None:
    docs = resources()
    assert {"Service", "Job"} <= set(docs), "the rendezvous Service and the Job are validated"
    validate_all(list(docs.values()), version)  # raises ValidationError on the first mismatch


def test_the_schemas_reject_a_wrong_field_and_versions_without_the_job_fields() -> None:
    job = resources()["Job"]
    typo = copy.deepcopy(job)
    typo["spec"]["podFailurePolicy"]["rules"][0]["onExitCode"] = typo["spec"]["podFailurePolicy"]["rules"][0].pop(
        "onExitCodes")
    for version in SUPPORTED:
        with pytest.raises(ValidationError, match="onExitCode"):
            validate_all([typo], version)
    no_status = copy.deepcopy(job)
    del no_status["spec"]["podFailurePolicy"]["rules"][2]["onPodConditions"][0]["status"]
    with pytest.raises(ValidationError, match="'status' is a required property"):
        validate_all([no_status], "1.34")  # optional only from 1.35 on
    with pytest.raises(ValidationError, match="successPolicy"):
        validate_all([job], "1.29")  # below the supported versions


def pod_failure_action(policy: dict, container: str, exit_code: int) -> str:
    """What the Job controller does with a pod whose container ended with `exit_code`: the first
    rule that matches, else Count (against backoffLimit)."""
    for rule in policy["rules"]:
        codes = rule.get("onExitCodes")
        if codes and codes.get("containerName", container) == container and \
                (exit_code in codes["values"]) == (codes["operator"] == "In"):
            return rule["action"]
    return "Count"


def test_the_pod_failure_policy_acts_on_keels_exit_codes() -> None:
    spec = resources()["Job"]["spec"]
    pod = spec["template"]["spec"]
    (container,) = pod["containers"]
    actions = {code: pod_failure_action(spec["podFailurePolicy"], container["name"], code)
               for code in (EXIT_BAD_INPUT, EXIT_GUARD_STOP, EXIT_PAUSED, EXIT_QUARANTINE, EXIT_HANG, 1, 137)}
    assert actions == {EXIT_BAD_INPUT: "FailJob", EXIT_GUARD_STOP: "FailJob", EXIT_PAUSED: "Ignore",
                       EXIT_QUARANTINE: "Ignore", EXIT_HANG: "Count", 1: "Count", 137: "Count"}
    assert {"type": "DisruptionTarget", "status": "True"} in spec["podFailurePolicy"]["rules"][2]["onPodConditions"]
    # What the API server requires beyond the schemas: podFailurePolicy needs restartPolicy Never and
    # allows only the Failed replacement policy; a success policy needs an Indexed Job.
    assert (pod["restartPolicy"], spec["podReplacementPolicy"], spec["completionMode"]) == ("Never", "Failed",
                                                                                              "Indexed")
    assert spec["successPolicy"] == {"rules": [{"succeededIndexes": "0"}]}


def test_pods_find_the_rendezvous_and_keep_off_quarantined_nodes() -> None:
    kinds = resources()
    service, job = kinds["Service"], kinds["Job"]
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    args = container["args"]
    assert service["spec"]["clusterIP"] == "None" and pod["subdomain"] == service["metadata"]["name"]
    assert service["spec"]["selector"] == {"batch.kubernetes.io/job-name": job["metadata"]["name"]}
    port = service["spec"]["ports"][0]["port"]
    assert args[args.index("--rdzv-endpoint") + 1] == f"{job['metadata']['name']}-0.{pod['subdomain']}:{port}"
    assert args[args.index("--nnodes") + 1].split(":")[1] == str(spec["completions"]) == str(spec["parallelism"])
    grace = int(next(a for a in args if a.startswith("health.shutdown_grace_s=")).split("=")[1])
    assert pod["terminationGracePeriodSeconds"] > grace
    node = next(e for e in container["env"] if e["name"] == "KEEL_NODE")
    assert node["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    (term,) = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert term["matchExpressions"] == [{"key": "keel/quarantined", "operator": "DoesNotExist"}]
    assert '"keel/quarantined": "true"' in (REPO / "deploy/k8s/keel-pod.sh").read_text()
    # keel-pod may label nodes: the pod's service account is bound to a role that patches them.
    binding = kinds["ClusterRoleBinding"]
    assert binding["subjects"][0]["name"] == pod["serviceAccountName"] == kinds["ServiceAccount"]["metadata"]["name"]
    assert binding["roleRef"]["name"] == kinds["ClusterRole"]["metadata"]["name"]
    assert {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "patch"]} in kinds["ClusterRole"]["rules"]


def test_the_image_is_the_one_the_dockerfile_builds_as_the_makefile_installs() -> None:
    dockerfile = (REPO / "Dockerfile").read_text()
    makefile = (REPO / "Makefile").read_text()
    torch = re.search(r"^TORCH := (\S+)$", makefile, re.M).group(1)
    assert f"--index-url \"$TORCH_INDEX_URL\" {torch}\n" in dockerfile and "TORCH_INDEX_URL ?=" in makefile
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu\n" in dockerfile  # CPU unless told
    version = re.search(r'^version = "(.+)"$', (REPO / "pyproject.toml").read_text(), re.M).group(1)
    container = resources()["Job"]["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == f"keel:{version}-cu128"
    build = ("docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 "
             f"-t {container['image']} .")
    for doc in ("Dockerfile", "docs/deploy.md", "deploy/k8s/keel-job.yaml"):
        assert build in (REPO / doc).read_text(), doc
    assert f"COPY deploy/k8s/keel-pod.sh /usr/local/bin/{container['command'][0]}\n" in dockerfile
    assert container["args"][:4] == ["keel", "train", "--config", "configs/llama3_8b.toml"]
    ignored = {line for line in (REPO / ".dockerignore").read_text().splitlines() if not line.startswith("#")}
    assert {".git", ".venv", "runs", "data"} <= ignored
    for copied in re.findall(r"^COPY (.+) \S+$", dockerfile, re.M):
        for path in copied.split():
            assert (REPO / path).exists() and path.split("/")[0] not in ignored, path


def test_keel_pod_passes_sigterm_on_and_exits_with_the_pause(small_corpus: Path, tmp_path: Path) -> None:
    """The container's first process gets the SIGTERM of a preemption: keel must see it, pause, and the
    pod must end with keel's 75 (a shell that dropped the signal would end 143, keel still running)."""
    run_dir, tag = tmp_path / "run", uuid.uuid4().hex
    cmd = [sys.executable, "-m", "keel", "train", "--run-dir", str(run_dir), *SMALL_RUN, "train.steps=200",
           f"data.dir={small_corpus}", 'drill.inject=["slow:rank=-1,seconds=0.1"]']
    pod = subprocess.Popen(["bash", str(REPO / "deploy/k8s/keel-pod.sh"), *cmd], cwd=tmp_path,
                           env={**keel_env(), TAG: tag}, start_new_session=True, text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while read_status(run_dir).get("step", 0) < 3:
            assert pod.poll() is None and time.monotonic() < deadline, "keel did not reach step 3"
            time.sleep(0.05)
        pod.send_signal(signal.SIGTERM)  # to the wrapper alone, as the runtime signals PID 1
        _, err = pod.communicate(timeout=120)
    finally:
        kill_tagged(tag)
    assert pod.returncode == EXIT_PAUSED, err[-3000:]
    assert read_status(run_dir)["state"] == "paused"


def test_the_pods_command_is_one_keel_accepts(tmp_path: Path) -> None:
    """The pod's `keel train` gets past its options and config; here it stops where the cluster's volume
    would be (cwd: the repository, as the image's working directory holds configs/)."""
    args = resources()["Job"]["spec"]["template"]["spec"]["containers"][0]["args"][1:]
    args[args.index("--run-dir") + 1] = str(tmp_path / "run")
    result = run_keel(args, cwd=REPO)
    assert result.returncode == EXIT_BAD_INPUT, result.stderr[-3000:]
    assert "data directory '/runs/data/llama3' does not exist" in result.stderr


REPLICAS = REPO / "deploy/k8s/keel-replicas.yaml"


@pytest.mark.parametrize("version", SUPPORTED)
def test_the_replica_group_example_matches_the_kubernetes_schemas(version: str) -> None:
    docs = list(yaml.safe_load_all(REPLICAS.read_text()))
    assert {d["kind"] for d in docs} == {"Deployment", "Service", "Job"}
    validate_all(docs, version)


def test_the_replica_group_example_runs_one_group_per_index_under_one_lighthouse() -> None:
    docs = {d["kind"]: d for d in yaml.safe_load_all(REPLICAS.read_text())}
    job, service = docs["Job"], docs["Service"]
    container = job["spec"]["template"]["spec"]["containers"][0]
    command = " ".join(container["args"])
    assert f"fault_tolerance.replica_groups={job['spec']['completions']}" in command
    assert f"fault_tolerance.lighthouse=http://{service['metadata']['name']}:{service['spec']['ports'][0]['port']}" \
        in command
    env = {e["name"]: e for e in container["env"]}
    assert env["KEEL_REPLICA_GROUP"]["valueFrom"]["fieldRef"]["fieldPath"].endswith("job-completion-index']")
    assert "groups/$KEEL_REPLICA_GROUP" in command and "checkpoint.dir=" in command
    rules = job["spec"]["podFailurePolicy"]["rules"]
    assert pod_failure_action({"rules": rules}, "keel", EXIT_QUARANTINE) == "FailIndex"
    assert pod_failure_action({"rules": rules}, "keel", 1) == "Count"
