"""What a restart of the same job reuses from its last start's probes, and what makes it measure again."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from keel.rundir.events import host
from keel.train.reuse import PROBES, REUSE_MAX_AGE_S, job_key, remember, reused


def test_job_key_names_the_launcher_of_every_rank(group: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KEEL_LAUNCHED_AT", raising=False)
    assert job_key(1) is None  # no `keel train` launcher: no restart to reuse anything for
    monkeypatch.setenv("KEEL_LAUNCHED_AT", "1234.5")
    assert job_key(1) == [[host(), "1234.5"]]


def test_a_result_is_reused_only_for_what_it_was_measured_on(group: None, tmp_path: Path) -> None:
    depends = {"job": [["node-a", "1234.5"]], "checkpoint_dir": "/ckpt", "probe_mib": 4}
    remember(tmp_path, "preflight", depends, [{"name": "storage_writable", "ok": True}])
    remember(tmp_path, "peak_flops", {"job": depends["job"], "dtype": "torch.float32"}, 1.5e11)
    kept = reused(tmp_path, "preflight", dict(depends))
    assert kept is not None and kept["value"] == [{"name": "storage_writable", "ok": True}]
    assert reused(tmp_path, "peak_flops", {"job": depends["job"], "dtype": "torch.float32"})["value"] == 1.5e11
    # Another launcher (a new `keel train`), other hosts, another setting, or no job: measured again.
    assert reused(tmp_path, "preflight", {**depends, "job": [["node-a", "999.0"]]}) is None
    assert reused(tmp_path, "preflight", {**depends, "job": [["node-b", "1234.5"]]}) is None
    assert reused(tmp_path, "preflight", {**depends, "checkpoint_dir": "/other"}) is None
    assert reused(tmp_path, "preflight", None) is None
    assert reused(tmp_path, "peak_flops", {"job": depends["job"], "dtype": "torch.bfloat16"}) is None
    # An hour-old result is measured again.
    kept_file = tmp_path / PROBES
    probes = json.loads(kept_file.read_text())
    probes["preflight"]["time"] -= REUSE_MAX_AGE_S + 1
    kept_file.write_text(json.dumps(probes))
    assert reused(tmp_path, "preflight", depends) is None
    assert reused(tmp_path, "peak_flops", {"job": depends["job"], "dtype": "torch.float32"}) is not None
    kept_file.write_text("{damaged")
    assert reused(tmp_path, "peak_flops", {"job": depends["job"], "dtype": "torch.float32"}) is None
