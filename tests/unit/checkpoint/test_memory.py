"""The memory tier in one process: a resume takes the newest checkpoint of either tier (memory at the same step),
a copy in memory that does not verify gives way to the next, and a tier that cannot serve the job is refused
before anything starts, in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from keel.checkpoint import flat
from keel.checkpoint.manager import CheckpointManager
from keel.checkpoint.memory import MEMORY_DIR_ENV, check_memory_tier, held_in_memory, memory_root, memory_tier
from keel.checkpoint.storage import Storage
from keel.config import load_config
from keel.core.state import TrainState
from keel.errors import CheckpointError, ConfigError
from keel.rundir.events import EventLog, read_jsonl


class Tiers:
    """A model, its optimizer, a storage manager with a memory tier, and the tier's own writer."""

    def __init__(self, run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Linear(16, 16)
        self.optimizer = torch.optim.AdamW(self.model.parameters())
        self.cfg = load_config(None, [f"checkpoint.dir={run_dir / 'ckpt'}", "checkpoint.memory_interval=5"])
        monkeypatch.setenv(MEMORY_DIR_ENV, str(run_dir / "shm"))
        self.events_path = run_dir / "events.jsonl"
        self.manager = CheckpointManager(self.cfg, run_dir, "dp=1", EventLog(self.events_path, rank=0),
                                         memory=memory_tier(self.cfg))
        assert self.manager.memory_writer is not None
        self.memory = self.manager.memory_writer

    def step(self, step: int, *writers: CheckpointManager) -> None:
        """One update, then a save of its state by each of `writers`."""
        self.model(torch.randn(2, 16)).sum().backward()
        self.optimizer.step()
        for writer in writers:
            (outcome,) = writer.save([self.model], [self.optimizer], TrainState(step=step), wait=True)
            assert outcome.committed, outcome.error

    def restored(self) -> tuple[int, str]:
        got = self.manager.restore([self.model], [self.optimizer], "auto", lambda line: None)
        assert got is not None
        return got[0].step, got[1]


def test_a_resume_takes_the_newest_step_of_either_tier_and_memory_at_the_same_step(
        tmp_path: Path, group: None, monkeypatch: pytest.MonkeyPatch) -> None:
    tiers = Tiers(tmp_path, monkeypatch)
    tiers.step(5, tiers.memory)
    tiers.step(10, tiers.manager, tiers.memory)
    kept = {k: v.clone() for k, v in tiers.model.state_dict().items()}
    tiers.step(15, tiers.memory)
    tiers.step(20, tiers.manager)
    assert tiers.restored() == (20, f"{tmp_path / 'ckpt'}/step-000020"), "storage is newer"
    (tmp_path / "ckpt" / "step-000020" / "manifest.json").unlink()
    assert tiers.restored() == (15, f"{tmp_path / 'shm'}/step-000015"), "then memory"
    assert sorted(p.name for p in (tmp_path / "shm").glob("step-*")) == ["step-000010", "step-000015"], "two kept"
    with open(tmp_path / "shm" / "step-000015" / "flat-rank-00000.bin", "r+b") as f:
        f.truncate(10)
    assert tiers.restored() == (10, f"{tmp_path / 'shm'}/step-000010"), "a tie goes to memory"
    assert all(torch.equal(v, kept[k]) for k, v in tiers.model.state_dict().items())
    assert not (tmp_path / "shm" / "step-000015").exists(), "the copy that failed is gone"
    actions = [(e["kind"], e["action"], e["step"]) for e in read_jsonl(tiers.events_path)
               if e["action"] in ("restored", "skipped")]
    assert actions == [("memory", "restored", 15), ("checkpoint", "skipped", 20), ("memory", "restored", 10),
                       ("memory", "skipped", 15)]


def test_the_memory_tier_writes_each_ranks_shards_as_they_are_and_restores_them_bitwise(
        tmp_path: Path, group: None, monkeypatch: pytest.MonkeyPatch) -> None:
    tiers = Tiers(tmp_path, monkeypatch)
    tiers.step(5, tiers.memory)
    saved = ({k: v.clone() for k, v in tiers.model.state_dict().items()},
             {k: v.clone() for k, v in tiers.optimizer.state_dict()["state"][0].items()})
    files = sorted(p.name for p in (tmp_path / "shm" / "step-000005").iterdir())
    assert files == ["flat-rank-00000.bin", "flat-rank-00000.json", "manifest.json", "rng-rank-00000.pt",
                     "train_state.json"], "no DCP metadata or records: the rank's own bytes"
    manifest = json.loads((tmp_path / "shm" / "step-000005" / "manifest.json").read_text())
    assert manifest["dcp_files"] == ["flat-rank-00000.bin", "flat-rank-00000.json"]
    tiers.step(6)  # the live state moves on
    assert tiers.restored() == (5, f"{tmp_path / 'shm'}/step-000005")
    assert all(torch.equal(v, saved[0][k]) for k, v in tiers.model.state_dict().items())
    assert all(torch.equal(v, saved[1][k]) for k, v in tiers.optimizer.state_dict()["state"][0].items())


def test_a_flat_checkpoint_of_two_shards_restores_into_one_whole_tensor_and_refuses_a_gap(tmp_path: Path) -> None:
    """Two ranks wrote the halves of a row-sharded weight (as FSDP shards dim 0); one process restores it whole."""
    storage = Storage(tmp_path)
    storage.makedirs("step-000001")
    weight = torch.arange(12.0).reshape(4, 3)
    for rank, half in enumerate(weight.chunk(2)):
        flat.save(storage, "step-000001", {"model": {"w": half.clone(), "n": torch.tensor(7)}, "optim": {}}, rank)
        index = tmp_path / "step-000001" / flat.names(rank)[1]
        listed = json.loads(index.read_text())
        listed["entries"][0][5:] = [[4, 3], [2 * rank, 0]]  # global shape, and where this rank's rows start
        index.write_text(json.dumps(listed))
    into = {"model": {"w": torch.zeros(4, 3), "n": torch.tensor(0)}, "optim": {}}
    flat.load(storage, "step-000001", into, rank=0, ranks=2)
    assert torch.equal(into["model"]["w"], weight) and int(into["model"]["n"]) == 7
    (tmp_path / "step-000001" / flat.names(1)[1]).write_text(
        (tmp_path / "step-000001" / flat.names(0)[1]).read_text())  # rank 1's rows listed as rank 0's
    with pytest.raises(CheckpointError, match=r"its shards cover 6 of the 12 elements of model 'w' on rank 0"):
        flat.load(storage, "step-000001", into, rank=0, ranks=2)


def test_a_flat_share_of_other_shapes_is_refused_naming_the_tensor(tmp_path: Path) -> None:
    storage = Storage(tmp_path)
    storage.makedirs("step-000001")
    state = {"model": {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(3, dtype=torch.bfloat16)},
             "optim": {"lr": 0.1}}
    taken = flat.save(storage, "step-000001", state, rank=0)
    assert {name: size for name, (size, _) in taken.items()} == storage.files("step-000001")
    into = {"model": {"w": torch.zeros(2, 3), "b": torch.zeros(3, dtype=torch.bfloat16)}, "optim": {"lr": 0.0}}
    flat.load(storage, "step-000001", into, rank=0, ranks=1)
    assert torch.equal(into["model"]["w"], state["model"]["w"]) and torch.equal(into["model"]["b"], state["model"]["b"])
    assert into["optim"]["lr"] == 0.1
    with pytest.raises(CheckpointError, match=r"its model 'w' is float32 \[2, 3\], here float32 \[3, 2\]"):
        flat.load(storage, "step-000001", {"model": {"w": torch.zeros(3, 2), "b": into["model"]["b"]}, "optim": {}},
                  0, 1)
    with pytest.raises(CheckpointError, match=r"it lacks model 'c' \(1 tensors missing\)"):
        flat.load(storage, "step-000001", {**into, "model": {**into["model"], "c": torch.zeros(1)}}, 0, 1)


def test_the_launcher_holds_the_tier_for_the_job_and_removes_it_after(tmp_path: Path) -> None:
    cfg = load_config(None, ["checkpoint.memory_interval=5", f"checkpoint.memory_dir={tmp_path / 'shm'}"])
    with held_in_memory(cfg, tmp_path / "run", nproc=2) as root:
        assert root == tmp_path / "shm" and root.is_dir()
        tier = memory_tier(cfg)
        assert tier is not None and tier.storage.path() == str(root) and tier.policy.keep_last == 2
        (root / "step-000005").mkdir()
    assert not root.exists() and memory_tier(cfg) is None
    off = load_config(None, [])
    with held_in_memory(off, tmp_path / "run", nproc=2) as none:
        assert none is None
    assert memory_root("", tmp_path / "a") != memory_root("", tmp_path / "b"), "one tier per run directory"
    assert memory_root("", tmp_path / "a", "node-0") != memory_root("", tmp_path / "a", "node-1"), \
        "one tier per node, where several nodes of a job share a machine"


@pytest.mark.parametrize(("overrides", "restarts", "expect"), [
    (["fault_tolerance.replica_groups=2"], 1, "replica groups heal from a live group"),
    ([], 0, "--max-restarts 0"),
])
def test_a_memory_tier_that_cannot_serve_the_job_is_refused_in_one_line(
        overrides: list[str], restarts: int, expect: str) -> None:
    cfg = load_config(None, ["checkpoint.memory_interval=5", *overrides])
    with pytest.raises(ConfigError, match=expect) as refused:
        check_memory_tier(cfg, restarts)
    assert "\n" not in str(refused.value) and "checkpoint.memory_interval = 0" in str(refused.value)
    check_memory_tier(load_config(None, []), 0)  # off: nothing to refuse


def test_a_memory_tier_larger_than_the_free_shared_memory_is_refused_before_it_is_made(tmp_path: Path) -> None:
    cfg = load_config(None, ["checkpoint.memory_interval=5", f"checkpoint.memory_dir={tmp_path / 'shm'}",
                             "model.dim=16384", "model.n_layers=400", "model.n_heads=128", "model.n_kv_heads=8"])
    with pytest.raises(ConfigError, match=r"needs .* free; .*checkpoint.memory_interval = 0"), \
            held_in_memory(cfg, tmp_path / "run", nproc=2):
        pass
    assert not (tmp_path / "shm").exists()
