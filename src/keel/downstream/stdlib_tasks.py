"""keel's shipped lm-eval tasks (configs/tasks), over the held-out documents of the built-in corpus (the Python
standard library's sources, as `make train` prepares them with the byte tokenizer):

- `keel_stdlib_next_line`, multiple choice: after a few lines of a held-out file, which of four lines comes next
  (the real one, or a line of another held-out file).
- `keel_stdlib_heldout`, perplexity: the beginning of each held-out file, scored over windows of the model's context.

Their data are small JSON Lines files beside the task YAML, read by `next_line` and `heldout` (lm-eval's
`custom_dataset`, so the files are found wherever keel is installed, with no network). They are made from a corpus
prepared by `keel data prepare --config tiny`, deterministically: `python -m keel.downstream.stdlib_tasks CORPUS`
writes them again. The held-out split is chosen by each document's content (`keel.data.prepare.is_validation`), so a
file of another Python's standard library that differs from the one used here may be held out or not.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

import numpy as np

from keel.data.shards import open_corpus
from keel.data.tokenizer import ByteTokenizer

TASKS = Path(__file__).resolve().parents[1] / "configs" / "tasks"  # installed with the package
NEXT_LINE, HELDOUT = "stdlib_next_line.jsonl", "stdlib_heldout.jsonl"
MADE_WITH = (3, 11, 7)  # the Python whose standard library the shipped files were made from
CONTEXT_CHARS = 400  # the lines before a question, at most this many characters
PER_FILE = 12  # questions per held-out file
# Every choice fits the context of a model of 64 tokens (with the byte tokenizer, a token per byte): lm-eval's
# Hugging Face model refuses a continuation longer than the context.
LINE_BYTES = 60
CHOICES = 4
HELDOUT_BYTES = 4096  # the perplexity task's share of each file: its first lines, at most this many bytes


def heldout_documents(corpus: Path) -> list[str]:
    """The validation documents of a byte-tokenizer corpus, in the order of its shards."""
    prepared = open_corpus(corpus)
    tok = ByteTokenizer()
    if prepared.manifest["tokenizer"]["name"] != tok.name:
        raise SystemExit(f"{corpus} is not tokenized with the byte tokenizer; prepare it with `keel data prepare "
                         f"--config tiny`")
    tokens = np.concatenate([np.asarray(shard) for shard in prepared.splits["val"]])
    starts, ends = np.flatnonzero(tokens == tok.bos), np.flatnonzero(tokens == tok.eos)
    return [tok.decode(tokens[start + 1:end]) for start, end in zip(starts, ends, strict=True)]


def _head(text: str, limit: int) -> str:
    """The whole lines at the start of `text` that fit in `limit` bytes (the first line, cut, if none does)."""
    kept, size = [], 0
    for line in text.splitlines(keepends=True):
        size += len(line.encode())
        if size > limit:
            break
        kept.append(line)
    return "".join(kept) or text.encode()[:limit].decode(errors="ignore")


def _candidates(doc: str) -> list[int]:
    """Lines worth asking about: with at least 10 characters besides indentation, at most LINE_BYTES bytes, and 3
    lines before them."""
    lines = doc.splitlines()
    return [i for i in range(3, len(lines)) if len(lines[i].strip()) >= 10 and len(lines[i].encode()) <= LINE_BYTES]


def next_line_rows(docs: list[str], seed: int = 0) -> list[dict[str, Any]]:
    """PER_FILE questions per document: the lines before (at most CONTEXT_CHARS) and four choices, the real next
    line among three lines of other documents, its place drawn at random."""
    rng = random.Random(seed)
    lines = [doc.splitlines() for doc in docs]
    pool = [(d, lines[d][i]) for d, doc in enumerate(docs) for i in _candidates(doc)]
    rows = []
    for d, doc in enumerate(docs):
        for i in sorted(rng.sample(_candidates(doc), min(PER_FILE, len(_candidates(doc))))):
            context = "".join(line + "\n" for line in lines[d][:i])
            if len(context) > CONTEXT_CHARS:  # whole lines only
                context = context[-CONTEXT_CHARS:].split("\n", 1)[-1]
            answer = lines[d][i]
            others: list[str] = []
            while len(others) < CHOICES - 1:
                other, line = rng.choice(pool)
                if other != d and line != answer and line not in others:
                    others.append(line)
            place = rng.randrange(CHOICES)
            rows.append({"context": context, "choices": [*others[:place], answer, *others[place:]], "answer": place})
    return rows


def heldout_rows(docs: list[str]) -> list[dict[str, Any]]:
    return [{"text": _head(doc, HELDOUT_BYTES)} for doc in docs]


def write(corpus: Path, out: Path = TASKS) -> list[Path]:
    """The task data of the held-out documents of `corpus`, written into `out`."""
    docs = heldout_documents(corpus)
    written = []
    for name, rows in ((NEXT_LINE, next_line_rows(docs)), (HELDOUT, heldout_rows(docs))):
        (out / name).write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
        written.append(out / name)
    return written


# ---------------------------------------------------------------- lm-eval's custom_dataset

def rows(name: str) -> list[dict[str, Any]]:
    """The rows of a shipped JSON Lines file."""
    return [json.loads(line) for line in (TASKS / name).read_text(encoding="utf-8").splitlines()]


def dataset(name: str) -> Any:
    """The rows of a shipped JSON Lines file as the test split of a Hugging Face dataset."""
    import datasets

    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows(name))})


def next_line(**_: Any) -> Any:
    return dataset(NEXT_LINE)


def heldout(**_: Any) -> Any:
    return dataset(HELDOUT)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m keel.downstream.stdlib_tasks CORPUS (from `keel data prepare --config "
                         "tiny`)")
    for path in write(Path(sys.argv[1])):
        print(path)
