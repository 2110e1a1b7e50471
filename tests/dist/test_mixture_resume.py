"""A run drawing from two weighted sources, with a schedule change, resumes bitwise after a real SIGKILL and
consumes each source's tokens in the scheduled shares."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from keel.checkpoint.inspect import state_sha256
from keel.config import DataConfig, SourceConfig
from keel.data.prepare import prepare
from keel.rundir.events import read_jsonl
from tests.conftest import SMALL_RUN, SMALL_SOURCES, run_keel

pytestmark = pytest.mark.dist

STEPS, SWITCH, KILL_AT, BATCH, SEQ = 30, 15, 10, 8, 64
MIXTURE = ["data.sources.code.weight=0.7", "data.sources.mail.weight=0.3",
           f"data.schedule=[{{step = {SWITCH}, weights = {{code = 0.2, mail = 0.8}}}}]"]


@pytest.mark.timeout(300)
def test_mixture_run_resumes_bitwise_and_draws_the_scheduled_shares(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    prepare(DataConfig(sources={"code": SourceConfig(paths=[SMALL_SOURCES[0], SMALL_SOURCES[2]]),
                                "mail": SourceConfig(paths=[SMALL_SOURCES[1]])}, val_fraction=0.05), corpus)
    sources = [f"data.sources.{name}.paths={paths}" for name, paths in
               (("code", [SMALL_SOURCES[0], SMALL_SOURCES[2]]), ("mail", [SMALL_SOURCES[1]]))]

    def cmd(run_dir: Path, *extra: str) -> list[str]:
        return ["train", "--nproc", "2", "--run-dir", str(run_dir), *SMALL_RUN, f"train.steps={STEPS}",
                f"data.dir={corpus}", "checkpoint.interval=10", *sources, *MIXTURE, *extra]

    reference, killed = tmp_path / "reference", tmp_path / "killed"
    kill = f'callbacks=[{{path = "keel.drill.faults:SigkillAfterCheckpoint", args = {{step = {KILL_AT}, rank = 1}}}}]'
    with ThreadPoolExecutor(max_workers=2) as pool:
        first = [pool.submit(run_keel, cmd(reference), cwd=tmp_path),
                 pool.submit(run_keel, cmd(killed, kill), cwd=tmp_path)]
        clean, interrupted = (f.result() for f in first)
    assert clean.returncode == 0, clean.stderr
    assert interrupted.returncode != 0 and not (killed / "checkpoints" / f"step-{STEPS:06d}").exists()
    resumed = run_keel(cmd(killed, kill), cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert [e["step"] for e in read_jsonl(killed / "events.jsonl") if e["kind"] == "resume"] == [KILL_AT]

    final = f"step-{STEPS:06d}"
    assert state_sha256(killed / "checkpoints" / final) == state_sha256(reference / "checkpoints" / final)
    # Tokens consumed per source follow the weights of each phase within one sequence.
    for run_dir in (reference, killed):
        last = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "data/tokens/code" in r][-1]
        assert last["step"] == STEPS
        expected = {"code": BATCH * (SWITCH * 0.7 + (STEPS - SWITCH) * 0.2),
                    "mail": BATCH * (SWITCH * 0.3 + (STEPS - SWITCH) * 0.8)}
        for name, sequences in expected.items():
            assert abs(last[f"data/tokens/{name}"] / SEQ - sequences) < 1, (name, last)
