"""keel's shipped tasks (configs/tasks) scored by keel itself, where lm-evaluation-harness is not installed: the
same requests, metrics and standard errors as lm-eval computes from the tasks' YAML (a test compares the two), so
that `keel eval RUN --tasks keel_stdlib_next_line` works in a runtime-only install."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

from keel.downstream.scoring import Scorer
from keel.downstream.stdlib_tasks import HELDOUT, NEXT_LINE, rows

Metrics = dict[str, float]


def _mean_and_stderr(name: str, values: list[float]) -> Metrics:
    """The mean and its standard error (the sample's standard deviation over √n), as lm-eval reports `acc`."""
    mean = sum(values) / len(values)
    spread = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else math.nan
    return {name: mean, f"{name}_stderr": spread / math.sqrt(len(values))}


def next_line(scorer: Scorer, questions: list[dict[str, Any]]) -> Metrics:
    """Multiple choice: the choice of highest log-likelihood (`acc`), or per character of the choice (`acc_norm`)."""
    pairs = [scorer.pair(q["context"], choice) for q in questions for choice in q["choices"]]
    scores = iter(score for score, _ in scorer.loglikelihood(pairs))
    acc, acc_norm = [], []
    for q in questions:
        lls = [next(scores) for _ in q["choices"]]
        per_char = [ll / len(choice) for ll, choice in zip(lls, q["choices"], strict=True)]
        acc.append(float(lls.index(max(lls)) == q["answer"]))
        acc_norm.append(float(per_char.index(max(per_char)) == q["answer"]))
    return {**_mean_and_stderr("acc", acc), **_mean_and_stderr("acc_norm", acc_norm)}


def heldout(scorer: Scorer, texts: list[dict[str, Any]]) -> Metrics:
    """Perplexity over the whole texts, per word (runs of non-space) and per byte, and bits per byte."""
    total = sum(scorer.rolling(t["text"]) for t in texts)
    words = sum(len(re.split(r"\s+", t["text"])) for t in texts)
    size = sum(len(t["text"].encode()) for t in texts)
    return {"word_perplexity": math.exp(-total / words), "byte_perplexity": math.exp(-total / size),
            "bits_per_byte": -total / size / math.log(2)}


TASKS: dict[str, tuple[str, Callable[[Scorer, list[dict[str, Any]]], Metrics]]] = {
    "keel_stdlib_next_line": (NEXT_LINE, next_line), "keel_stdlib_heldout": (HELDOUT, heldout)}


def run_shipped(scorer: Scorer, tasks: list[str], limit: int | None = None) -> dict[str, Metrics]:
    """Each task's scores over its first `limit` examples (all by default)."""
    return {task: TASKS[task][1](scorer, rows(TASKS[task][0])[:limit]) for task in tasks}
