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


def plural(n: int, one: str, many: str) -> str:
    return f"{n:,} {one if n == 1 else many}"


def _counts(counts: dict[str, int]) -> str:
    shown = [f"{name} {n:,}" for name, n in sorted(counts.items(), key=lambda kv: -kv[1]) if n]
    return ", ".join(shown) or "none"


def _malformed(stats: dict) -> list[str]:
    """The count of malformed lines and rows (left out, the rest of their file kept), the first files with their
    counts, and the first few by file:line."""
    n = stats["malformed"]
    if not n:
        return ["malformed         0"]
    by_file = stats.get("malformed_by_file", [])
    files = stats.get("malformed_files", len(by_file))
    shown = ", ".join(f"{f['path']} {f['count']:,}" for f in by_file[:3]) + (", ..." if files > 3 else "")
    return [f"malformed         {n:,} in {plural(files, 'file', 'files')}" + (f" ({shown})" if shown else ""),
            f"                  {', '.join(stats['malformed_lines'][:3])}{', ...' if n > 3 else ''}"]


def _skipped(skipped: list[dict]) -> list[str]:
    """Every damaged input file, skipped whole, with where its damage is."""
    return [f"skipped files     {len(skipped):,}" + (" (damaged: none of their documents are in the corpus)"
                                                     if skipped else ""),
            *(f"  {s['path']}: {s['reason']}" for s in skipped)]


def _undecodable(stats: dict) -> str:
    """The documents kept with U+FFFD in place of bytes that were not UTF-8 (or JSON's lone surrogate escapes)."""
    n = stats.get("undecodable", 0)
    if not n:
        return "undecodable       0"
    return (f"undecodable       {plural(n, 'document', 'documents')} kept with U+FFFD for what was not valid Unicode "
            f"({', '.join(stats['undecodable_documents'][:3])}{', ...' if n > 3 else ''})")


def format_stats(stats: dict) -> str:
    lsh, docs, contamination = stats["lsh"], stats["documents"], stats.get("contamination")
    lines = [
        f"documents in      {stats['documents_in']:,} ({stats['source_bytes'] / 1e6:,.1f} MB)" + (
            f", and {stats['outside_source_length']:,} left by a source to another by length"
            if stats.get("outside_source_length") else ""),
        *_malformed(stats),
        *_skipped(stats.get("skipped_files", [])),
        _undecodable(stats),
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
