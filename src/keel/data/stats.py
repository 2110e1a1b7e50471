"""`keel data stats DIR`: what a prepare kept and removed, and why, from the corpus's stats.json."""

from __future__ import annotations

import json
from pathlib import Path

from keel.data.shards import read_manifest
from keel.errors import DataError

STATS = "stats.json"


def load_stats(directory: str | Path) -> dict:
    directory = Path(directory)
    read_manifest(directory)  # a prepared corpus, or the one-line error that says what to do
    path = directory / STATS
    if not path.is_file():
        raise DataError(f"{str(directory)!r} has no {STATS}: it was prepared by an older keel; prepare it again "
                        f"(`keel data prepare --out {directory} --force`)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise DataError(f"{str(path)!r} is not valid JSON ({e}); prepare the corpus again") from None


def _counts(counts: dict[str, int]) -> str:
    shown = [f"{name} {n:,}" for name, n in sorted(counts.items(), key=lambda kv: -kv[1]) if n]
    return ", ".join(shown) or "none"


def format_stats(stats: dict) -> str:
    lsh, docs, contamination = stats["lsh"], stats["documents"], stats.get("contamination")
    lines = [
        f"documents in      {stats['documents_in']:,} ({stats['source_bytes'] / 1e6:,.1f} MB)",
        f"malformed         {stats['malformed']:,}" + (f" ({', '.join(stats['malformed_lines'][:3])}"
                                                       f"{', ...' if stats['malformed'] > 3 else ''})"
                                                       if stats["malformed"] else ""),
        f"removed by filter {_counts(stats['removed_by_filter'])}",
        f"changed by filter {_counts(stats['changed_by_filter'])}",
        f"exact duplicates  {stats['exact_duplicates']:,}",
        f"near duplicates   {stats['near_duplicates']:,} (MinHash-LSH on {lsh['shingle']}, {lsh['num_perm']} "
        f"permutations, threshold {lsh['threshold']})",
        f"                  {lsh['formula']}",
        f"decontaminated    {stats['decontaminated']:,}" + (
            f" (training documents sharing a {contamination['n']}-word n-gram with the validation split or "
            f"{contamination['eval_files']} evaluation files: {contamination['ngrams']:,} distinct n-grams)"
            if contamination else " (off)"),
        f"documents out     {stats['documents_out']:,} ({docs['train']:,} train, {docs['val']:,} validation)",
        f"tokenizer         {stats['tokenizer']['name']}, vocabulary {stats['tokenizer']['vocab_size']:,}, "
        f"{stats['tokens_per_byte']:.3f} tokens per byte",
    ]
    for name, s in stats["sources"].items():
        lines.append(f"source {name:<10} {s['files']:,} files: {s['train_tokens']:,} train tokens in "
                     f"{s['train_documents']:,} documents, {s['val_tokens']:,} validation tokens")
    hist = stats["length_histogram"]
    bins, counts = hist["bins_tokens"], hist["documents"]
    widest = max(counts) if counts and max(counts) else 1
    lines.append("document length in tokens:")
    for i, n in enumerate(counts):
        upper = f"{bins[i + 1]:,}" if i + 1 < len(bins) else "more"
        lines.append(f"  {bins[i]:>9,} – {upper:<9} {n:>9,} {'█' * round(30 * n / widest)}")
    return "\n".join(lines)
