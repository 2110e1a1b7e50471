"""keel's MinHash-LSH near-dedup against datasketch's, on a generated corpus with planted near-duplicate pairs.

The corpus: random documents of 200-400 words drawn with Zipf-like frequencies from a large vocabulary of
random 3-8 letter words, so unrelated documents share almost no word 5-gram. Planted pairs copy a base
document and replace words at random positions until the exact Jaccard similarity of the two word-5-gram sets
reaches a level: 1.0 (a copy), 0.95, 0.9 and 0.8 from above (the fewest edits keeping J >= level), 0.7, 0.5,
0.3 and 0.1 from below (the fewest edits bringing J <= level). The number of edits is found by bisection on a
fixed random edit order, J being computed exactly with Python sets each time. Recall is the share of pairs with
J >= 0.9 that end up in one cluster, precision one minus the share of pairs with J <= 0.5 that do.

Both sides start from the raw texts and use the same word 5-gram shingles, num_perm, threshold and
(bands, rows). keel: `MinHasher.signatures` on the whole corpus, then `near_duplicate_roots`. datasketch:
`MinHash.bulk` (update_batch per document, shared permutations) on the shingles as bytes, `MinHashLSH`
insert and query, and the query results joined with a union-find. Each side is warmed up, then run
--repeats times in alternating order; medians are reported. Results go to bench/results/dedup.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import string
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from keel.data.dedup import MinHasher, UnionFind, lsh_formula, lsh_params, near_duplicate_roots

RESULTS = Path(__file__).parent / "results" / "dedup.json"
LEVELS = (1.0, 0.95, 0.9, 0.8, 0.7, 0.5, 0.3, 0.1)
NGRAM = 5


def make_vocabulary(size: int, rng: np.random.Generator) -> np.ndarray:
    """`size` distinct random lowercase words of 3 to 8 letters."""
    letters = np.array(list(string.ascii_lowercase))
    words: set[str] = set()
    while len(words) < size:
        lengths = rng.integers(3, 9, size=size)
        chars = letters[rng.integers(0, 26, size=(size, 8))]
        words.update("".join(row[:k]) for row, k in zip(chars, lengths, strict=True))
    return np.array(sorted(words)[:size])


def gram_set(ids: np.ndarray) -> set[tuple[int, ...]]:
    seq = ids.tolist()
    if len(seq) < NGRAM:
        return {tuple(seq)}
    return set(zip(*(seq[k:] for k in range(NGRAM)), strict=False))


def jaccard(a: set, b: set) -> float:
    return len(a & b) / len(a | b) if a or b else 1.0


def plant(base: np.ndarray, level: float, rng: np.random.Generator,
          draw: Callable[[int], np.ndarray]) -> tuple[np.ndarray, float]:
    """A copy of `base` with k words replaced, k chosen by bisection so that J lands at `level` (see above)."""
    positions = rng.permutation(len(base))
    replacements = draw(len(base))
    original = gram_set(base)

    def edited(k: int) -> tuple[np.ndarray, float]:
        out = base.copy()
        out[positions[:k]] = replacements[:k]
        return out, jaccard(original, gram_set(out))

    from_above = level >= 0.75
    lo, hi = 0, len(base)  # J is non-increasing in k (new words almost never recreate an original 5-gram)
    while lo < hi:
        mid = (lo + hi + 1) // 2 if from_above else (lo + hi) // 2
        ok = edited(mid)[1] >= level if from_above else edited(mid)[1] <= level
        if from_above:
            lo, hi = (mid, hi) if ok else (lo, mid - 1)
        else:
            lo, hi = (lo, mid) if ok else (mid + 1, hi)
    return edited(lo)


def make_corpus(n_docs: int, seed: int, pair_share: float = 0.5,
                vocab_size: int = 50_000) -> tuple[list[str], list[tuple[int, int, float]]]:
    """`n_docs` texts, `pair_share` of them in planted pairs spread evenly over LEVELS, in shuffled order.

    Returns the texts and the planted pairs as (i, j, exact word-5-gram Jaccard), pair n aiming at
    LEVELS[n % len(LEVELS)].
    """
    rng = np.random.default_rng(seed)
    vocab = make_vocabulary(vocab_size, rng)
    cdf = np.cumsum(1.0 / (np.arange(vocab_size) + 10.0))  # Zipf-like: a few common words, a long tail
    cdf /= cdf[-1]

    def draw(k: int) -> np.ndarray:
        return np.minimum(np.searchsorted(cdf, rng.random(k)), vocab_size - 1)

    n_pairs = int(n_docs * pair_share) // 2
    docs = [draw(int(rng.integers(200, 401))) for _ in range(n_docs - n_pairs)]
    planted = []
    for p in range(n_pairs):
        copy, sim = plant(docs[p], LEVELS[p % len(LEVELS)], rng, draw)
        planted.append((p, len(docs), sim))
        docs.append(copy)
    order = rng.permutation(len(docs))
    where = np.argsort(order)
    texts = [" ".join(vocab[docs[i]]) for i in order]
    pairs = [(int(where[i]), int(where[j]), sim) for i, j, sim in planted]
    return texts, pairs


def word_shingle_bytes(text: str) -> list[bytes]:
    """keel's word 5-gram shingles as bytes: lowercased words, a text shorter than 5 words is one shingle."""
    words = text.lower().split()
    if len(words) < NGRAM:
        return [" ".join(words).encode()] if words else []
    return [" ".join(words[i:i + NGRAM]).encode() for i in range(len(words) - NGRAM + 1)]


def keel_roots(texts: list[str], num_perm: int, threshold: float, params: tuple[int, int],
               seed: int = 1) -> tuple[np.ndarray, dict[str, float]]:
    start = time.perf_counter()
    signatures = MinHasher(num_perm, seed, "word", NGRAM).signatures(texts)
    middle = time.perf_counter()
    roots = near_duplicate_roots(signatures, params[0], params[1], threshold)
    end = time.perf_counter()
    return roots, {"signatures_s": middle - start, "lsh_s": end - middle, "total_s": end - start}


def datasketch_roots(texts: list[str], num_perm: int, threshold: float, params: tuple[int, int],
                     seed: int = 1) -> tuple[np.ndarray, dict[str, float]]:
    from datasketch import MinHash, MinHashLSH

    start = time.perf_counter()
    sketches = MinHash.bulk((word_shingle_bytes(t) for t in texts), num_perm=num_perm, seed=seed)
    middle = time.perf_counter()
    lsh = MinHashLSH(threshold=threshold, num_perm=num_perm, params=params)
    for i, sketch in enumerate(sketches):
        lsh.insert(i, sketch, check_duplication=False)
    left, right = [], []
    for i, sketch in enumerate(sketches):
        found = lsh.query(sketch)
        left.extend([i] * len(found))
        right.extend(found)
    sets = UnionFind(len(texts))
    sets.union(np.array(left, dtype=np.int64), np.array(right, dtype=np.int64))
    end = time.perf_counter()
    return sets.parent.copy(), {"signatures_s": middle - start, "lsh_s": end - middle, "total_s": end - start}


def quality(roots: np.ndarray, pairs: list[tuple[int, int, float]]) -> dict[str, float]:
    """Recall on pairs with J >= 0.9, precision on pairs with J <= 0.5, and the joined share per level."""
    joined = {(i, j): bool(roots[i] == roots[j]) for i, j, _ in pairs}
    high = [joined[i, j] for i, j, s in pairs if s >= 0.9]
    low = [joined[i, j] for i, j, s in pairs if s <= 0.5]
    planted = {d for i, j, _ in pairs for d in (i, j)}
    stray = sum(1 for d in range(len(roots)) if roots[d] != d and d not in planted)
    by_level = {}
    for k, level in enumerate(LEVELS):
        members = [joined[i, j] for n, (i, j, _) in enumerate(pairs) if n % len(LEVELS) == k]
        by_level[str(level)] = float(np.mean(members)) if members else float("nan")
    return {"recall_j_ge_0.9": float(np.mean(high)), "precision_j_le_0.5": 1.0 - float(np.mean(low)),
            "unplanted_merged": stray, "joined_by_level": by_level}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--docs", type=int, default=20_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-perm", type=int, default=128)
    ap.add_argument("--threshold", type=float, default=0.8)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per side; medians are reported")
    args = ap.parse_args()
    start = time.perf_counter()
    texts, pairs = make_corpus(args.docs, args.seed)
    generated_s = time.perf_counter() - start
    params = lsh_params(args.threshold, args.num_perm)
    print(f"{len(texts)} documents, {len(pairs)} planted pairs (generated in {generated_s:.1f} s)")
    print(lsh_formula(*params))

    sides = {"keel": keel_roots, "datasketch": datasketch_roots}
    for run in sides.values():  # warm-up: imports, first-touch of hash tables and power tables
        run(texts[:200], args.num_perm, args.threshold, params)
    timings: dict[str, list[dict[str, float]]] = {name: [] for name in sides}
    roots: dict[str, np.ndarray] = {}
    for repeat in range(args.repeats):  # alternate which side goes first
        for name in (list(sides) if repeat % 2 == 0 else list(sides)[::-1]):
            roots[name], timing = sides[name](texts, args.num_perm, args.threshold, params)
            timings[name].append(timing)
    results = {}
    for name in sides:
        median = {key: statistics.median(t[key] for t in timings[name]) for key in timings[name][0]}
        results[name] = {**median, "docs_per_s": len(texts) / median["total_s"], **quality(roots[name], pairs),
                         "timings": timings[name]}
    ratio = results["datasketch"]["total_s"] / results["keel"]["total_s"]

    print(f"{'':<12}{'docs/s':>10}{'signatures s':>14}{'lsh s':>8}{'recall J>=.9':>14}{'precision J<=.5':>17}")
    for name, r in results.items():
        print(f"{name:<12}{r['docs_per_s']:>10.0f}{r['signatures_s']:>14.2f}{r['lsh_s']:>8.2f}"
              f"{r['recall_j_ge_0.9']:>14.4f}{r['precision_j_le_0.5']:>17.4f}")
    print("joined share by level:", {k: [round(results[s]["joined_by_level"][k], 3) for s in sides]
                                     for k in results["keel"]["joined_by_level"]}, "(keel, datasketch)")
    print(f"speed-up keel/datasketch = {ratio:.1f}x (target >= 5)")
    import datasketch

    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "benchmark": "dedup", "docs": len(texts), "planted_pairs": len(pairs), "seed": args.seed,
        "repeats": args.repeats, "num_perm": args.num_perm, "threshold": args.threshold,
        "bands": params[0], "rows": params[1],
        "keel": results["keel"], "datasketch": results["datasketch"], "speedup": ratio, "target": 5.0,
        "datasketch_version": datasketch.__version__, "numpy": np.__version__, "machine": platform.machine(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }, indent=1) + "\n")


if __name__ == "__main__":
    main()
