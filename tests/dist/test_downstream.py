"""Downstream evaluation through lm-evaluation-harness, on tasks the test writes (lm-eval YAML with local
data files, no Hub): `keel eval` on a checkpoint (keel's model adapter) and on its Hugging Face export
(lm-eval's own Hugging Face model) give the same scores; the adapter's log-likelihoods are the model's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import run_keel

pytestmark = pytest.mark.dist

OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def write_tasks(root: Path) -> Path:
    """Three tasks, one per kind of request: multiple choice (loglikelihood), perplexity (loglikelihood_rolling)
    and completion (generate_until)."""
    root.mkdir()
    choice = [{"question": f"def {name}(self):\n    return", "choices": [" self", " None", " 0", " ''"], "answer": a}
              for a, name in enumerate(["get", "value", "count", "name", "run", "close"])]
    text = [{"text": "import os\nimport sys\n\n\ndef main():\n    return 0\n" * k} for k in (1, 2, 30)]
    prompts = [{"prompt": f"import {m}\nimport", "answer": " os"} for m in ("sys", "re", "json")]
    for name, rows in (("choice", choice), ("text", text), ("prompts", prompts)):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = "dataset_path: json\ntest_split: test\n"
    (root / "keel_choice.yaml").write_text(
        f"task: keel_choice\n{common}dataset_kwargs:\n  data_files:\n    test: {root / 'choice.jsonl'}\n"
        "output_type: multiple_choice\ndoc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\n"
        "doc_to_target: '{{answer}}'\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n")
    (root / "keel_text.yaml").write_text(
        f"task: keel_text\n{common}dataset_kwargs:\n  data_files:\n    test: {root / 'text.jsonl'}\n"
        "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\nmetric_list:\n"
        "  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n")
    (root / "keel_prompts.yaml").write_text(
        f"task: keel_prompts\n{common}dataset_kwargs:\n  data_files:\n    test: {root / 'prompts.jsonl'}\n"
        "output_type: generate_until\ndoc_to_text: '{{prompt}}'\ndoc_to_target: '{{answer}}'\n"
        "generation_kwargs:\n  until: ['\\n']\n  max_gen_toks: 6\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n")
    return root


TASKS = "keel_choice,keel_text,keel_prompts"


def test_a_checkpoint_and_its_hf_export_get_the_same_scores(reference_run: Path, tmp_path: Path) -> None:
    pytest.importorskip("lm_eval")
    pytest.importorskip("transformers")
    tasks = write_tasks(tmp_path / "tasks")
    hf = tmp_path / "hf"
    exported = run_keel(["ckpt", "export", str(reference_run), "--out", str(hf)], cwd=tmp_path)
    assert exported.returncode == 0, exported.stderr
    scores = {}
    for name, target in (("keel", reference_run), ("hf", hf)):
        done = run_keel(["eval", str(target), "--tasks", TASKS, "--include", str(tasks), "--device", "cpu",
                         "--batch-size", "4", "--out", str(tmp_path / f"{name}.json")], cwd=tmp_path, env=OFFLINE)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
        scores[name] = json.loads((tmp_path / f"{name}.json").read_text())
        assert "keel_choice" in done.stdout and "acc_norm" in done.stdout
    keel, hf_scores = scores["keel"], scores["hf"]
    assert keel["step"] == 40 and keel["checkpoint"].endswith("step-000040")
    assert set(keel["tasks"]) == {"keel_choice", "keel_text", "keel_prompts"}
    for task, metrics in keel["tasks"].items():
        assert set(metrics) == set(hf_scores["tasks"][task])
        for metric, value in metrics.items():
            assert value == pytest.approx(hf_scores["tasks"][task][metric], rel=1e-4, abs=1e-6), (task, metric)
    assert 0 <= keel["tasks"]["keel_choice"]["acc"] <= 1
    assert 1 < keel["tasks"]["keel_text"]["byte_perplexity"] < 259  # better than chance over the byte vocabulary


def test_the_adapter_scores_a_continuation_with_the_model_s_own_log_probabilities(reference_run: Path) -> None:
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance

    from keel.downstream.models import keel_lm, keel_model

    scorer, loaded = keel_model(str(reference_run), torch.device("cpu"), batch_size=2)
    lm = keel_lm(scorer)
    context, continuation = "def main():\n    return", " 0\n\n\ndef helper():\n    pass\n"
    (score, greedy), = lm.loglikelihood([Instance("loglikelihood", {}, (context, continuation), 0)])
    ids = [int(i) for i in scorer.tok.encode_documents([context + continuation])[0][1:-1]]
    n = len(continuation.encode())  # the byte tokenizer: one token per byte
    with torch.no_grad():
        logprobs = F.log_softmax(scorer.logits(torch.tensor([ids])).float(), -1)[0]
    expected = sum(float(logprobs[i - 1, ids[i]]) for i in range(len(ids) - n, len(ids)))
    assert score == pytest.approx(expected, rel=1e-5)
    assert greedy == all(int(logprobs[i - 1].argmax()) == ids[i] for i in range(len(ids) - n, len(ids)))
    assert loaded["step"] == 40
    (generated,) = lm.generate_until([Instance("generate_until", {}, ("import", {"until": ["\n"],
                                                                                  "max_gen_toks": 5}), 0)])
    assert len(generated.encode()) <= 5 and "\n" not in generated


def test_in_training_evaluation_logs_the_scores_of_the_checkpoint_and_changes_nothing(
        reference_run: Path, small_corpus: Path, tmp_path: Path) -> None:
    pytest.importorskip("lm_eval")
    from keel.rundir.events import read_jsonl
    from tests.conftest import SMALL_RUN

    tasks = write_tasks(tmp_path / "tasks")
    run_dir = tmp_path / "run"
    done = run_keel(["train", "--nproc", "2", "--run-dir", str(run_dir), *SMALL_RUN, "train.steps=40",
                     f"data.dir={small_corpus}", "checkpoint.interval=10", "checkpoint.keep_last=10",
                     'eval.downstream_tasks=["keel_choice", "keel_text"]', f'eval.downstream_include=["{tasks}"]',
                     "eval.downstream_interval=20"], cwd=tmp_path, env=OFFLINE)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    records = read_jsonl(run_dir / "metrics.jsonl")
    logged = {r["step"]: r for r in records if "eval/keel_choice/acc" in r}
    assert sorted(logged) == [20, 40]
    # FSDP on 2 processes scores what the checkpoint of the same step scores in one process
    offline = run_keel(["eval", str(run_dir / "checkpoints" / "step-000020"), "--tasks", "keel_choice,keel_text",
                        "--include", str(tasks), "--device", "cpu", "--json"], cwd=tmp_path, env=OFFLINE)
    assert offline.returncode == 0, offline.stderr[-3000:]
    scores = json.loads(offline.stdout.strip().splitlines()[-1])["tasks"]
    for task, metrics in scores.items():
        for metric, value in metrics.items():
            if not metric.endswith("_stderr"):
                assert logged[20][f"eval/{task}/{metric}"] == pytest.approx(value, rel=1e-4), (task, metric)
    # the evaluations changed nothing the run computes: its losses are the run without them, bit for bit
    losses = {r["step"]: r["train/loss"] for r in records if "train/loss" in r}
    reference = {r["step"]: r["train/loss"] for r in read_jsonl(reference_run / "metrics.jsonl") if "train/loss" in r}
    assert losses == reference
    report = run_keel(["report", str(run_dir)], cwd=tmp_path)
    assert report.returncode == 0 and "Downstream tasks" in (run_dir / "report.html").read_text()


def test_keel_s_own_tasks_score_a_trained_checkpoint_offline(reference_run: Path, tmp_path: Path) -> None:
    """The shipped tasks, as `keel eval runs/tiny --tasks ...` runs them after `make train`: found without
    --include, their data read from the package with no network."""
    pytest.importorskip("lm_eval")
    done = run_keel(["eval", str(reference_run), "--tasks", "keel_stdlib_next_line,keel_stdlib_heldout", "--device",
                     "cpu", "--batch-size", "16", "--out", str(tmp_path / "scores.json")], cwd=tmp_path, env=OFFLINE)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "keel_stdlib_next_line" in done.stdout and "byte_perplexity" in done.stdout
    tasks = json.loads((tmp_path / "scores.json").read_text())["tasks"]
    next_line, heldout = tasks["keel_stdlib_next_line"], tasks["keel_stdlib_heldout"]
    assert 0 <= next_line["acc"] <= 1 and next_line["acc_stderr"] > 0
    # 40 steps on other files of the standard library already predict its held-out files better than chance
    assert 1 < heldout["byte_perplexity"] < 256 and heldout["bits_per_byte"] < 8
    assert heldout["bits_per_byte"] == pytest.approx(torch.log2(torch.tensor(heldout["byte_perplexity"])).item(),
                                                     rel=1e-4)
