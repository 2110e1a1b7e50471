"""A save's data files are checksummed as they are written: the manifest's checksums are those of the
files on disk, only the files written outside DCP are read back, and torch's own per-record CRC32, which
those checksums make redundant, is not computed."""

from __future__ import annotations

import io
import json
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import xxhash
from torch.distributed.checkpoint import FileSystemReader
from torch.serialization import get_crc32_options

from keel.checkpoint.digesting import DigestingWriter, _Digesting
from keel.checkpoint.manager import CheckpointManager
from keel.checkpoint.storage import Storage
from keel.config import load_config
from keel.core.state import TrainState
from keel.rundir.events import EventLog


def test_the_manifest_holds_the_checksums_of_the_files_on_disk_and_dcps_files_are_not_read_back(
        tmp_path: Path, group: None, monkeypatch: pytest.MonkeyPatch) -> None:
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 64)).sum().backward()
    optimizer.step()
    cfg = load_config(None, [f"checkpoint.dir={tmp_path / 'ckpt'}"])
    manager = CheckpointManager(cfg, tmp_path, "dp=1", EventLog(tmp_path / "events.jsonl", rank=0))
    read_back: list[str] = []
    digest = Storage.digest
    monkeypatch.setattr(Storage, "digest", lambda self, name: read_back.append(name) or digest(self, name))
    (outcome,) = manager.save([model], [optimizer], TrainState(step=3), wait=True)
    assert outcome.committed
    monkeypatch.undo()
    files = json.loads((Path(outcome.path) / "manifest.json").read_text())["files"]
    storage = Storage(tmp_path / "ckpt")
    assert {".metadata", "__0_0.distcp"} <= set(files)
    for name, entry in files.items():
        assert entry["size"] == (Path(outcome.path) / name).stat().st_size
        assert entry["xxh3_128"] == storage.digest(f"step-000003/{name}"), name
    assert sorted(Path(n).name for n in read_back) == ["rng-rank-00000.pt", "train_state.json"]


def test_a_stream_that_was_not_written_in_one_sequential_run_gets_no_checksum() -> None:
    straight = _Digesting(io.BytesIO())
    straight.write(b"abc")
    straight.write(memoryview(torch.arange(4, dtype=torch.int32).numpy()))
    assert straight.digest() is not None and straight.digest()[0] == 3 + 16  # type: ignore[index]
    seeking = _Digesting(io.BytesIO())
    seeking.write(b"abcdef")
    seeking.seek(2)
    seeking.write(b"X")
    assert seeking.digest() is None


def test_dcps_records_carry_no_crc32_of_their_own_and_load_back_exactly(tmp_path: Path, group: None) -> None:
    state = {"w": torch.randn(300, 7), "step": torch.tensor(5)}
    writer = DigestingWriter(tmp_path)
    dcp.save(state, storage_writer=writer)
    assert get_crc32_options()  # torch.save elsewhere keeps its CRC32
    records = FileSystemReader(tmp_path).read_metadata().storage_data.values()
    data = (tmp_path / "__0_0.distcp").read_bytes()
    assert writer.digests["__0_0.distcp"] == (len(data), xxhash.xxh3_128(data).hexdigest())
    for record in records:
        members = zipfile.ZipFile(io.BytesIO(data[record.offset:record.offset + record.length])).infolist()
        assert members and all(member.CRC == 0 for member in members)
    loaded = {"w": torch.zeros(300, 7), "step": torch.tensor(0)}
    dcp.load(loaded, checkpoint_id=tmp_path)
    assert torch.equal(loaded["w"], state["w"]) and int(loaded["step"]) == 5
