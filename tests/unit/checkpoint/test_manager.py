"""The checkpoint manager in one process under real storage faults: checkpoints that do not verify
are set aside, never deleted, and a volume that refuses a save (full, read-only) says so in one line
while the previous checkpoint stays as it was, byte for byte."""

from __future__ import annotations

import errno
import hashlib
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from keel.checkpoint.manager import CheckpointManager, _failure
from keel.checkpoint.manifest import verify
from keel.checkpoint.storage import Storage
from keel.cli import main
from keel.config import load_config
from keel.core.state import TrainState
from keel.errors import CheckpointError
from keel.rundir.events import EventLog, read_jsonl
from tests.conftest import tmpfs


@pytest.fixture
def volume(tmp_path: Path) -> Iterator[Path]:
    """A real 2 MiB filesystem (tmpfs); needs the right to mount (root, as in CI)."""
    with tmpfs(tmp_path / "volume", "2m") as mount:
        yield mount


class Run:
    """A model, its optimizer and a manager saving to `root`, as the trainer drives them."""

    def __init__(self, run_dir: Path, root: Path, *overrides: str) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Linear(64, 64)  # about 50 KiB of checkpoint with its Adam moments
        self.optimizer = torch.optim.AdamW(self.model.parameters())
        self.model(torch.randn(2, 64)).sum().backward()
        self.optimizer.step()
        cfg = load_config(None, [f"checkpoint.dir={root}", *overrides])
        self.events_path = run_dir / "events.jsonl"
        self.manager = CheckpointManager(cfg, run_dir, "dp=1", EventLog(self.events_path, rank=0))

    def save(self, step: int):
        (outcome,) = self.manager.save([self.model], [self.optimizer], TrainState(step=step), wait=True)
        return outcome

    def restore(self, resume: str = "auto"):
        return self.manager.restore([self.model], [self.optimizer], resume, lambda line: None)

    def events(self, action: str) -> list[dict]:
        return [e for e in read_jsonl(self.events_path) if e["action"] == action]


def hashes(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and ".locks" not in p.parts}


def saved(tmp_path: Path, steps: tuple[int, ...] = (10, 20, 30), *overrides: str) -> Run:
    run = Run(tmp_path, tmp_path / "ckpt", *overrides)
    assert all(run.save(s).committed for s in steps)
    return run


def test_a_checkpoint_without_manifest_or_truncated_is_set_aside_and_the_run_resumes_the_newest_that_verifies(
        tmp_path: Path, group: None) -> None:
    run = saved(tmp_path)
    root = tmp_path / "ckpt"
    (root / "step-000030" / "manifest.json").unlink()
    with open(root / "step-000020" / "__0_0.distcp", "r+b") as f:
        f.truncate(100)
    before = hashes(root)
    state, path = Run(tmp_path, root).restore() or (None, "")
    assert state.step == 10 and path == str(root / "step-000010")
    moved = {"step-000030": "step-000030.corrupt-no-manifest", "step-000020": "step-000020.corrupt-truncated"}
    after = hashes(root)
    assert after == {next((moved[k] + rest for k in moved if name.startswith(k + "/") and (rest := name[len(k):])),
                          name): h for name, h in before.items()}, "every file kept, byte for byte"
    assert [e["detail"]["moved_to"] for e in run.events("set_aside")] == [str(root / n) for n in moved.values()]
    reasons = [e["detail"]["reason"] for e in run.events("set_aside")]
    assert reasons[0] == "no manifest.json (it was removed or lost)" and "__0_0.distcp has 100 bytes" in reasons[1]
    assert (root / "latest").readlink() == Path("step-000010")


def test_when_no_checkpoint_verifies_the_error_is_one_line_and_nothing_changes(tmp_path: Path, group: None) -> None:
    saved(tmp_path)
    root = tmp_path / "ckpt"
    (root / "step-000030" / "manifest.json").unlink()
    (root / "step-000020" / "rng-rank-00000.pt").unlink()
    path = root / "step-000010" / "__0_0.distcp"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))
    before = hashes(root)
    with pytest.raises(CheckpointError) as e:
        Run(tmp_path, root).restore()
    message = str(e.value)
    assert len(message.splitlines()) == 1 and e.value.every_rank
    assert "step-000030: no manifest.json" in message and "step-000020: rng-rank-00000.pt is missing" in message
    assert "step-000010: __0_0.distcp does not match its checksum" in message and "nothing was changed" in message
    assert hashes(root) == before


def test_retention_removes_only_verified_checkpoints_and_keeps_the_newest_verified(tmp_path: Path,
                                                                                    group: None) -> None:
    run = saved(tmp_path, (10, 20), "checkpoint.keep_last=2")
    root = tmp_path / "ckpt"
    (root / "step-000020" / "manifest.json").unlink()  # the newest but one is lost before step 30 is saved
    kept = hashes(root)
    assert run.save(30).pruned == [] and run.save(40).pruned == ["step-000010"]
    assert sorted(p.name for p in root.glob("step-*")) == ["step-000020.corrupt-no-manifest", "step-000030",
                                                           "step-000040"]
    assert {k.replace("step-000020", "step-000020.corrupt-no-manifest"): v for k, v in kept.items()
            if k.startswith("step-000020/")}.items() <= hashes(root).items()
    run.manager.retire_after(35, run.manager.events, 41)  # a rollback to step 35 abandons step 40 only
    assert sorted(p.name for p in root.glob("step-*")) == ["step-000020.corrupt-no-manifest", "step-000030"]
    assert (root / "latest").readlink() == Path("step-000030")


def test_a_full_volume_fails_the_save_in_one_line_and_keeps_the_previous_checkpoint(
        tmp_path: Path, group: None, volume: Path) -> None:
    run = Run(tmp_path, volume / "ckpt")
    assert run.save(10).committed
    before = hashes(volume / "ckpt")
    with open(volume / "filler", "wb") as f, pytest.raises(OSError) as full:  # a real ENOSPC: the volume fills up
        while True:
            f.write(b"\0" * (1 << 16))
            f.flush()
    assert full.value.errno == errno.ENOSPC
    outcome = run.save(20)
    assert not outcome.committed and outcome.volume_error == "ENOSPC"
    assert outcome.error.startswith(f"No space left on device (ENOSPC) on {volume / 'ckpt' / 'step-000020.tmp'}: "
                                    f"the checkpoint needs ")
    assert f"({run.manager.last_bytes} bytes)" in outcome.error and "free" in outcome.error
    assert [e["detail"]["error"] for e in run.events("failed")] == [outcome.error]
    assert [e["step"] for e in run.events("checkpoint_failed")] == [20]
    assert hashes(volume / "ckpt") == before and not (volume / "ckpt" / "step-000020.tmp").exists()
    (volume / "filler").unlink()
    assert run.save(30).committed, "the next save succeeds once there is room"


def test_the_enospc_hidden_by_torchs_writer_is_found_from_the_free_space(
        tmp_path: Path, group: None, volume: Path) -> None:
    big = {"w": torch.zeros(1 << 20)}  # 4 MiB: twice the volume
    with pytest.raises(CheckpointException, match="unexpected pos") as hidden:  # no errno in sight
        dcp.save(big, storage_writer=Storage(volume).writer("x"))
    storage = Storage(volume)
    text, code, path, free = _failure(hidden.value, storage, share=4 << 20)
    assert code == errno.ENOSPC and path == str(volume) and free < 4 << 20, text


def test_a_volume_remounted_read_only_fails_the_save_cleanly(tmp_path: Path, group: None, volume: Path) -> None:
    run = Run(tmp_path, volume / "ckpt", 'checkpoint.on_storage_error="stop"')
    assert run.save(10).committed
    before = hashes(volume / "ckpt")
    subprocess.run(["mount", "-o", "remount,ro", str(volume)], check=True)
    try:
        outcome = run.save(20)
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(volume)], check=True)
    assert not outcome.committed and outcome.volume_error == "EROFS"
    assert outcome.error.startswith("Read-only file system (EROFS) on ") and len(outcome.error.splitlines()) == 1
    assert 'the run stops (checkpoint.on_storage_error = "stop")' in run.events("checkpoint_failed")[0]["detail"][
        "message"]
    assert hashes(volume / "ckpt") == before



@pytest.fixture
def open_root() -> Iterator[Path]:
    """A directory of root's (0755) that every user may enter, but only root may write in."""
    import shutil
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="keel-eacces-", dir="/tmp"))  # pytest's own directories are 0700
    root.chmod(0o755)
    try:
        yield root
    finally:
        shutil.rmtree(root)


def test_a_directory_this_user_may_not_write_fails_the_save_with_eacces_in_one_line(tmp_path: Path, group: None,
                                                                                     open_root: Path) -> None:
    """Root passes every permission check, so the process drops to an unprivileged effective user for the
    save, as a job running as a service account meets a volume owned by another."""
    import os

    if os.geteuid() != 0:
        pytest.skip("the test becomes another user for the save, which needs root")
    run = Run(tmp_path, open_root / "ckpt")
    assert run.save(10).committed
    before = hashes(open_root / "ckpt")
    os.seteuid(65534)  # nobody
    try:
        outcome = run.save(20)
    finally:
        os.seteuid(0)
    assert not outcome.committed and outcome.volume_error == "EACCES"
    assert outcome.error.startswith("Permission denied (EACCES) on ") and len(outcome.error.splitlines()) == 1
    assert [e["step"] for e in run.events("checkpoint_failed")] == [20]
    assert hashes(open_root / "ckpt") == before
    assert run.save(30).committed, "the next save, with the right to write, succeeds"


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))


def test_checks_started_before_the_model_is_built_still_refuse_a_corrupted_checkpoint(tmp_path: Path,
                                                                                      group: None) -> None:
    saved(tmp_path, (10, 20))
    root = tmp_path / "ckpt"
    _flip_a_byte(root / "step-000020" / "__0_0.distcp")
    run = Run(tmp_path, root)
    run.manager.prefetch("auto")
    checks = run.manager.prefetched
    assert checks is not None and checks.path == str(root / "step-000020")
    assert checks.metadata.result() == [] and checks.rest.result() == [
        "__0_0.distcp does not match its checksum in the manifest (corrupted)"]  # done before the load asks
    state, path = run.restore() or (None, "")
    assert state.step == 10 and path == str(root / "step-000010")
    assert [e["detail"]["moved_to"] for e in run.events("set_aside")] == [str(root / "step-000020.corrupt-checksum")]


def test_checks_of_a_checkpoint_saved_again_since_are_not_trusted(tmp_path: Path, group: None) -> None:
    """The step was saved again (another manifest) after its checks passed: the load checks it anew."""
    saved(tmp_path, (10, 20))
    root = tmp_path / "ckpt"
    run = Run(tmp_path, root)
    run.manager.prefetch("auto")
    assert run.manager.prefetched is not None and run.manager.prefetched.rest.result() == []
    with torch.no_grad():
        run.model.weight.add_(1.0)
    assert run.save(20).committed
    _flip_a_byte(root / "step-000020" / "__0_0.distcp")
    state, path = run.restore() or (None, "")
    assert state.step == 10 and path == str(root / "step-000010")


def test_nothing_is_checked_ahead_for_a_fresh_start_or_a_directory_without_checkpoints(tmp_path: Path,
                                                                                       group: None) -> None:
    run = Run(tmp_path, tmp_path / "ckpt")
    run.manager.prefetch("auto")
    assert run.manager.prefetched is None
    assert run.save(10).committed
    run.manager.prefetch("never")
    assert run.manager.prefetched is None


def test_a_file_written_after_its_checks_passed_is_checked_again(tmp_path: Path, group: None) -> None:
    saved(tmp_path, (10, 20))
    root = tmp_path / "ckpt"
    run = Run(tmp_path, root)
    run.manager.prefetch("auto")
    assert run.manager.prefetched is not None and run.manager.prefetched.rest.result() == []
    _flip_a_byte(root / "step-000020" / "__0_0.distcp")  # same size, same manifest
    state, path = run.restore() or (None, "")
    assert state.step == 10 and path == str(root / "step-000010")


def test_a_resume_keeps_the_optimizer_settings_of_the_config_and_the_moments_of_the_checkpoint(
        tmp_path: Path, group: None) -> None:
    """The saved optimizer state holds each group's settings too; a resume whose config changed them (a
    weight decay, an epsilon: options that may change) must train with the new ones."""
    run = saved(tmp_path, (10,))
    moments = {k: v.clone() for k, v in run.optimizer.state[run.model.weight].items()}
    fresh = Run(tmp_path, tmp_path / "ckpt")
    fresh.optimizer = torch.optim.AdamW(fresh.model.parameters(), weight_decay=0.5, eps=1e-6, betas=(0.8, 0.9))
    fresh.model(torch.randn(2, 64)).sum().backward()
    fresh.optimizer.step()  # its state exists, as the trainer's does before a load
    state, _ = fresh.restore() or (None, "")
    assert state is not None and state.step == 10
    (group_settings,) = fresh.optimizer.param_groups
    assert (group_settings["weight_decay"], group_settings["eps"], group_settings["betas"]) == (0.5, 1e-6, (0.8, 0.9))
    for key, value in moments.items():
        assert torch.equal(fresh.optimizer.state[fresh.model.weight][key], value), key


def test_a_checkpoint_whose_optimizer_grouped_its_parameters_otherwise_loads(tmp_path: Path, group: None) -> None:
    """Checkpoints written before the optimizer had its μP groups (two groups: matrices, vectors) resume into
    the three-group optimizer with every moment in place."""
    from keel.model.init import init_weights
    from keel.model.llama import Llama
    from keel.train.optim import build_optimizer

    cfg = load_config(None, [f"checkpoint.dir={tmp_path / 'ckpt'}", "model.dim=32", "model.n_layers=2",
                             "model.n_heads=4", "model.n_kv_heads=2"])
    saved_model, fresh = Llama(cfg.model), Llama(cfg.model)
    init_weights(saved_model, 0)
    init_weights(fresh, 1)
    two = torch.optim.AdamW([{"params": [p for p in saved_model.parameters() if p.ndim >= 2], "weight_decay": 0.1},
                             {"params": [p for p in saved_model.parameters() if p.ndim < 2], "weight_decay": 0.0}])
    three = build_optimizer(fresh, cfg.optim)
    for model, optimizer in ((saved_model, two), (fresh, three)):
        model(torch.randint(0, 200, (2, 8))).sum().backward()
        optimizer.step()
    events = EventLog(tmp_path / "events.jsonl", rank=0)
    CheckpointManager(cfg, tmp_path, "dp=1", events).save([saved_model], [two], TrainState(step=5), wait=True)
    restored = CheckpointManager(cfg, tmp_path, "dp=1", events).restore([fresh], [three], "auto", lambda line: None)
    assert restored is not None and restored[0].step == 5 and len(three.param_groups) == 3
    for before, after in zip(saved_model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(before, after)
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(two.state[before][key], three.state[after][key])


@pytest.mark.parametrize("written_by", ["keel", "a keel that wrote both names"])
def test_a_tied_embedding_is_written_once_and_a_resume_restores_it_under_both_names(
        tmp_path: Path, group: None, written_by: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from keel.checkpoint import manager as manager_module
    from keel.model.init import init_weights
    from keel.model.llama import Llama
    from keel.train.optim import build_optimizer

    cfg = load_config(None, [f"checkpoint.dir={tmp_path / 'ckpt'}", "model.dim=32", "model.n_layers=2",
                             "model.n_heads=4", "model.n_kv_heads=2", "model.tie_embeddings=true"])
    models = Llama(cfg.model), Llama(cfg.model)
    optimizers = tuple(build_optimizer(m, cfg.optim) for m in models)
    for seed, (model, optimizer) in enumerate(zip(models, optimizers, strict=True)):
        init_weights(model, seed)
        model(torch.randint(0, 200, (2, 8))).sum().backward()
        optimizer.step()
    events = EventLog(tmp_path / "events.jsonl", rank=0)
    if written_by != "keel":  # every name of the model's state dict, the tied one twice
        monkeypatch.setattr(manager_module, "_model_state", get_model_state_dict)
    outcome, = CheckpointManager(cfg, tmp_path, "dp=1", events).save([models[0]], [optimizers[0]],
                                                                     TrainState(step=5), wait=True)
    monkeypatch.undo()
    names = dcp.FileSystemReader(outcome.path).read_metadata().state_dict_metadata
    assert "model.tok_embeddings.weight" in names
    assert ("model.output.weight" in names) == (written_by != "keel")
    restored = CheckpointManager(cfg, tmp_path, "dp=1", events).restore([models[1]], [optimizers[1]], "auto",
                                                                        lambda line: None)
    assert restored is not None and restored[0].step == 5
    assert models[1].output.weight is models[1].tok_embeddings.weight  # still one tensor
    saved, fresh = get_model_state_dict(models[0]), get_model_state_dict(models[1])
    assert saved.keys() == fresh.keys() and all(torch.equal(saved[k], fresh[k]) for k in saved)
    for before, after in zip(models[0].parameters(), models[1].parameters(), strict=True):
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(optimizers[0].state[before][key], optimizers[1].state[after][key])


def _lose(fname: str):
    """An `on_write` hook that takes a file of DCP's from the save once it is written, as a process that
    removed the directory under a live save did: the truncation keeps the file, short."""

    def hook(step: int, staging: str) -> None:
        path = Path(staging) / fname
        if fname == "__0_0.distcp (short)":
            path = Path(staging) / "__0_0.distcp"
            with open(path, "r+b") as f:
                f.truncate(path.stat().st_size // 2)
        else:
            path.unlink()

    return hook


@pytest.mark.parametrize(("lost", "said"), [
    (".metadata", ".metadata is missing"),
    ("__0_0.distcp", "__0_0.distcp is missing"),
    ("__0_0.distcp (short)", "__0_0.distcp has "),
])
def test_a_save_without_what_dcp_needs_is_not_committed(tmp_path: Path, group: None, lost: str, said: str) -> None:
    run = saved(tmp_path, (10,))
    root = tmp_path / "ckpt"
    before = hashes(root)
    run.manager.on_write = _lose(lost)
    outcome = run.save(20)
    assert not outcome.committed and outcome.error.startswith("the save is incomplete, not committed: ")
    assert said in outcome.error
    assert not (root / "step-000020").exists() and not (root / "step-000020.tmp").exists()
    assert hashes(root) == before and (root / "latest").readlink() == Path("step-000010")
    assert [e["step"] for e in run.events("failed")] == [20] and not [e for e in run.events("committed")
                                                                       if e["step"] == 20]


def test_a_committed_manifest_names_the_files_dcp_needs(tmp_path: Path, group: None) -> None:
    saved(tmp_path, (10,))
    manifest = json.loads((tmp_path / "ckpt" / "step-000010" / "manifest.json").read_text())
    assert manifest["dcp_files"] == [".metadata", "__0_0.distcp"]
    assert set(manifest["dcp_files"]) <= set(manifest["files"])


def _without_tensors(checkpoint: Path, removed: str) -> None:
    """Take a file of DCP's away from a committed checkpoint: only from the disk, or (`manifest`) also from the
    manifest, written without `dcp_files`, as a save that lost its tensors before the commit was recorded."""
    if removed == "manifest":
        manifest = json.loads((checkpoint / "manifest.json").read_text())
        for fname in (".metadata", "__0_0.distcp"):
            del manifest["files"][fname]
            (checkpoint / fname).unlink()
        del manifest["dcp_files"]
        (checkpoint / "manifest.json").write_text(json.dumps(manifest))
    else:
        (checkpoint / removed).unlink()


@pytest.mark.parametrize("removed", [".metadata", "__0_0.distcp", "manifest"])
def test_a_checkpoint_without_its_tensors_is_corrupt_to_verify_ls_and_resume(
        tmp_path: Path, group: None, removed: str, capsys: pytest.CaptureFixture) -> None:
    saved(tmp_path, (10, 20))
    root = tmp_path / "ckpt"
    _without_tensors(root / "step-000020", removed)
    named = ".metadata" if removed == "manifest" else removed
    assert f"{named} is missing" in verify(Storage(root), "step-000020")[0]
    assert main(["ckpt", "verify", str(root)]) == 2
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"{root / 'step-000010'}: verified"
    assert out[1].startswith(f"{root / 'step-000020'}: FAILED: {named} is missing")
    assert main(["ckpt", "ls", str(root)]) == 0
    listed = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[1:]}
    assert f"CORRUPT: {named} is missing" in listed["step-000020"] and "complete" in listed["step-000010"]
    run = Run(tmp_path, root)
    state, path = run.restore() or (None, "")
    assert state.step == 10 and path == str(root / "step-000010")
    assert sorted(p.name for p in root.glob("step-*")) == ["step-000010", "step-000020.corrupt-missing-file"]
    assert [e["detail"]["path"] for e in run.events("skipped")] == [str(root / "step-000020")]
