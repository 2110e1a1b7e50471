"""keel's own scoring of its shipped tasks, used where lm-eval is not installed, gives lm-eval's numbers: every
metric and standard error lm-eval reports for the two tasks, on the same model."""

from __future__ import annotations

import pytest
import torch

from keel.config import ModelConfig
from keel.data.tokenizer import ByteTokenizer
from keel.downstream.native import TASKS, run_shipped
from keel.downstream.scoring import Scorer
from keel.downstream.tasks import shipped_tasks
from keel.model.init import init_weights
from keel.model.llama import Llama

CONTEXT = 64  # the longest choice is 60 bytes; a held-out text spans many windows


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # lm-eval 0.4.13 prefers TaskManager.load
def test_keel_scores_its_shipped_tasks_as_lm_eval_does(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("lm_eval")
    from keel.downstream.adapter import KeelLM
    from keel.downstream.tasks import run_tasks

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    torch.manual_seed(0)
    model = Llama(ModelConfig(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, vocab_size=259, max_seq_len=CONTEXT))
    init_weights(model, seed=0)
    scorer = Scorer(model, ByteTokenizer(), CONTEXT, torch.device("cpu"), batch_size=64)
    tasks = shipped_tasks()
    assert sorted(TASKS) == tasks
    theirs = run_tasks(KeelLM(scorer), tasks, [], limit=60)
    ours = run_shipped(scorer, tasks, limit=60)
    assert ours.keys() == theirs.keys()
    for task in tasks:
        assert ours[task].keys() == theirs[task].keys(), task
        for metric, value in theirs[task].items():
            assert ours[task][metric] == pytest.approx(value, rel=1e-9), (task, metric)
    accuracy = ours["keel_stdlib_next_line"]
    assert 0 < accuracy["acc"] < 1 and accuracy["acc_stderr"] > 0  # not a degenerate model: choices differ
