"""Mixture loader: several named sources drawn in weighted shares, scheduled, layout independent, resumable.

Source k's tokens are np.arange values from k × 10000 on, so the source of a sequence is its first token
// 10000 and its position in the source is (first token - k × 10000) // L. The sources hold different
numbers of sequences, so their epochs end at different batches and inside global batches.
"""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch

from keel.data.loader import GlobalOrderLoader, Mixture
from keel.errors import DataError

L = 4
FP = "f" * 64
SIZES = {"web": 13, "code": 7, "math": 5}  # sequences per source
NAMES = list(SIZES)


def make_sources(sizes: dict[str, int] = SIZES) -> dict[str, list[np.ndarray]]:
    """Each source in two shards (the second one starting a new run of sequences)."""
    out = {}
    for k, (name, n) in enumerate(sizes.items()):
        base, first = k * 10000, n // 2
        out[name] = [np.arange(base, base + first * L + 1, dtype=np.uint16),
                     np.arange(base + 5000, base + 5000 + (n - first) * L + 1, dtype=np.uint16)]
    return out


SOURCES = make_sources()


def rows_of(micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """(rows, L + 1) tokens rebuilt from (inputs, targets) micro-batches."""
    return torch.cat([torch.cat([x, y[:, -1:]], dim=1) for x, y in micro_batches])


def source_of(rows: torch.Tensor) -> np.ndarray:
    return rows[:, 0].numpy() // 10000


@pytest.fixture
def make():
    made: list[GlobalOrderLoader] = []

    def build(weights: dict[str, float] | None = None, *, schedule=(), global_batch: int = 32, micro_batch: int = 4,
              dp_rank: int = 0, dp_size: int = 1, seed: int = 0, skips=None, sources=None) -> GlobalOrderLoader:
        loader = GlobalOrderLoader(sources or SOURCES, weights=weights or {"web": 0.5, "code": 0.3, "math": 0.2},
                                   schedule=schedule, seq_len=L, global_batch=global_batch, micro_batch=micro_batch,
                                   dp_rank=dp_rank, dp_size=dp_size, seed=seed, fingerprint=FP, skips=skips)
        made.append(loader)
        return loader

    yield build
    for loader in made:
        loader.close()


def run(loader: GlobalOrderLoader, steps: int) -> list[torch.Tensor]:
    return [rows_of(loader.next()) for _ in range(steps)]


def test_shares_follow_the_weights_within_one_sequence(make):
    weights = {"web": 0.5, "code": 0.3, "math": 0.2}
    loader = make(weights)
    consumed = np.zeros(3, dtype=np.int64)
    for b in range(1000):
        rows = rows_of(loader.next())
        counts = np.bincount(source_of(rows), minlength=3)
        assert loader.last_batch == b and loader.last_batch_sources() == dict(zip(NAMES, counts.tolist(), strict=True))
        consumed += counts
        expected = np.array([weights[n] for n in NAMES]) * 32 * (b + 1)
        assert np.all(np.abs(expected - consumed) < 1), b
    shares = consumed / consumed.sum()
    assert np.allclose(shares, [0.5, 0.3, 0.2], atol=1e-4)
    assert loader.tokens_by_source() == {n: int(c) * L for n, c in zip(NAMES, consumed, strict=True)}
    assert loader.epochs() == {n: int(c) // SIZES[n] for n, c in zip(NAMES, consumed, strict=True)}
    assert loader.cursor == 1000 * 32 == loader.state_dict()["cursor"]


def test_each_source_visits_its_sequences_once_per_epoch(make):
    """Within a batch the order is shuffled, so the check is on counts: after every batch, each sequence of
    a source has been read e or e + 1 times, e being the source's completed epochs."""
    loader = make()
    seen = [np.zeros(n, dtype=np.int64) for n in SIZES.values()]
    for _ in range(40):
        rows = rows_of(loader.next())
        for k, (name, shards) in enumerate(SOURCES.items()):
            first = rows[source_of(rows) == k, 0].numpy() - k * 10000
            in_second = first >= 5000
            position = np.where(in_second, (len(shards[0]) - 1) // L + (first - 5000) // L, first // L)
            np.add.at(seen[k], position, 1)
            epoch = loader.epochs()[name]
            assert seen[k].min() == epoch and seen[k].max() <= epoch + 1, name
    assert all(e > 10 for e in loader.epochs().values())


@pytest.mark.parametrize(("weights", "global_batch"), [
    ({"a": 0.37, "b": 0.01, "c": 0.2, "d": 0.13, "e": 0.29}, 8),
    # awkward shares: many sources, a tiny batch, shares far below one sequence per batch
    ({"a": 0.001, "b": 0.01, "c": 1, "d": 0.4662789582213983, "e": 0.04703291581184044, "f": 0, "g": 1}, 1),
    ({"a": 1 / 3, "b": 1 / 7, "c": 0.0001, "d": 2, "e": 0.3, "f": 0.05}, 33),
])
def test_no_source_drifts_a_whole_sequence_from_its_share(weights, global_batch):
    names = list(weights)
    mixture = Mixture(names, weights, (), global_batch)
    share = np.array([weights[n] for n in names]) / sum(weights.values())
    consumed = np.zeros(len(names), dtype=np.int64)
    for b in range(3000):
        counts = mixture.counts(b, consumed.tolist(), 0)
        assert sum(counts) == global_batch and min(counts) >= 0
        consumed += counts
        assert np.all(np.abs(share * global_batch * (b + 1) - consumed) < 1), (b, consumed)
    assert consumed[share == 0].sum() == 0


def test_global_batches_do_not_depend_on_the_world_size(make):
    steps = 25
    reference = run(make(), steps)
    for dp_size in (2, 4):
        ranks = [make(dp_rank=r, dp_size=dp_size, micro_batch=2) for r in range(dp_size)]
        for b in range(steps):
            slices = [rows_of(rank.next()) for rank in ranks]
            assert torch.equal(torch.cat(slices), reference[b]), (dp_size, b)
    # every rank's slice mixes the sources, rather than one rank taking one source
    mixed = [len(np.unique(source_of(rows[r * 8:(r + 1) * 8]))) > 1 for rows in reference for r in range(4)]
    assert sum(mixed) >= 0.9 * len(mixed)


@pytest.mark.parametrize("k", [3, 20, 33, 47])
def test_resume_gives_the_uninterrupted_batches(make, k):
    """Across the schedule's change at batch 20 and a skipped range: resuming from the state of any
    batch, with another world size, through a JSON round trip, gives the same batches."""
    schedule = [(20, {"web": 0.1, "code": 0.1, "math": 0.8})]
    skips = [[30, 35]]
    reference = run(make(schedule=schedule, skips=skips), 50)
    first = make(schedule=schedule, skips=skips, dp_rank=1, dp_size=2, micro_batch=2)
    for _ in range(k):
        first.next()
    state = json.loads(json.dumps(first.state_dict()))
    assert state["batch"] == first.last_batch + 1 and sum(state["consumed"].values()) == state["cursor"]
    ranks = [make(schedule=schedule, dp_rank=r, dp_size=4, micro_batch=2) for r in range(4)]
    for rank in ranks:
        rank.load_state_dict(state)
    for b in range(k, 50):
        assert torch.equal(torch.cat([rows_of(rank.next()) for rank in ranks]), reference[b]), b
    assert ranks[0].state_dict() == make_state_after(make, schedule, skips, 50)


def make_state_after(make, schedule, skips, steps: int) -> dict:
    loader = make(schedule=schedule, skips=skips)
    run(loader, steps)
    return loader.state_dict()


def test_loading_a_state_discards_the_prefetched_batches(make):
    reference = run(make(), 12)
    loader = make()
    run(loader, 3)
    state = loader.state_dict()
    run(loader, 6)  # the prefetch thread has read further ahead still
    loader.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(run(loader, 9), reference[3:], strict=True))


def test_schedule_switches_the_weights_at_its_step(make):
    loader = make({"web": 1, "code": 1}, schedule=[(30, {"math": 1.0}), (60, {"web": 1, "code": 1, "math": 2})])
    assert loader.weights_at(29) == {"web": 0.5, "code": 0.5, "math": 0.0}
    assert loader.weights_at(30) == {"web": 0.0, "code": 0.0, "math": 1.0}
    counts = np.array([np.bincount(source_of(rows), minlength=3) for rows in run(loader, 100)])
    assert np.all(counts[:30] == [16, 16, 0])  # batch 29 is the last one of the first phase
    assert np.all(counts[30:60] == [0, 0, 32])
    assert np.all(np.abs(counts[60:].sum(axis=0) - np.array([0.25, 0.25, 0.5]) * 32 * 40) < 1)


def test_a_zero_weight_source_is_never_drawn(make):
    loader = make({"web": 1.0, "code": 0.0, "math": 3.0})
    drawn = np.concatenate([source_of(rows) for rows in run(loader, 200)])
    assert 1 not in drawn and np.isclose(np.mean(drawn == 2), 0.75, atol=1e-3)
    assert loader.tokens_by_source()["code"] == 0


def test_one_source_keeps_the_single_split_order(make):
    """Epoch e is default_rng([seed, e]).permutation(count); batch b is positions [b G, (b + 1) G) of the
    concatenated epochs; the source's name and weight change nothing."""
    only = {"solo": SOURCES["web"]}
    n, g, seed = SIZES["web"], 8, 3
    stream = np.concatenate([np.random.default_rng([seed, e]).permutation(n) for e in range(20)])
    first = {n_: int(t) for n_, t in enumerate(np.concatenate([s[:-1:L] for s in SOURCES["web"]])[:n])}
    loader = make({"solo": 2.0}, sources=only, global_batch=g, seed=seed)
    plain = GlobalOrderLoader(SOURCES["web"], seq_len=L, global_batch=g, micro_batch=4, dp_rank=0, dp_size=1,
                              seed=seed, fingerprint=FP)
    try:
        for b in range(25):
            rows = rows_of(loader.next())
            assert [first[i] for i in stream[b * g:(b + 1) * g]] == rows[:, 0].tolist(), b
            assert torch.equal(rows_of(plain.next()), rows)
    finally:
        plain.close()


def test_skipping_thousands_of_batches_is_bookkeeping_only(make):
    reference = make(global_batch=4, micro_batch=4)
    for _ in range(2003):
        reference.next()
    after = rows_of(reference.next())
    skipping = make(global_batch=4, micro_batch=4, skips=[[3, 2003]])
    run(skipping, 3)
    began = time.perf_counter()
    got = rows_of(skipping.next())
    assert time.perf_counter() - began < 1.0
    assert skipping.last_batch == 2003 and torch.equal(got, after)
    assert skipping.state_dict()["consumed"] == reference.state_dict()["consumed"]


@pytest.mark.parametrize(("weights", "schedule", "match"), [
    ({"web": 0, "code": 0, "math": 0}, (), "all 0"),
    ({"web": 1, "code": -1}, (), "finite number >= 0"),
    ({"web": 1, "prose": 1}, (), "'prose'.*web, code, math"),
    ({"web": 1}, [(10, {"code": 0})], "phase at step 10 are all 0"),
    ({"web": 1}, [(10, {"code": 1}), (10, {"math": 1})], "distinct"),
])
def test_bad_weights_are_refused(weights, schedule, match):
    with pytest.raises(DataError, match=match):
        GlobalOrderLoader(SOURCES, weights=weights, schedule=schedule, seq_len=L, global_batch=8, micro_batch=4,
                          dp_rank=0, dp_size=1, seed=0, fingerprint=FP)


def test_a_state_with_other_sources_needs_allow_corpus_change(make):
    two = {"web": SOURCES["web"], "code": SOURCES["code"]}
    old = make({"web": 1, "code": 1}, sources=two)
    run(old, 10)
    state = old.state_dict()
    loader = make()
    with pytest.raises(DataError, match="source 'math'.*allow_corpus_change"):
        loader.load_state_dict(state)
    with pytest.raises(DataError, match="source 'web'"):  # a state from before sources had names
        loader.load_state_dict({"epoch": 0, "cursor": 64, "seed": 0, "fingerprint": FP})
    assert loader.batch == 0
    dropped = make({"web": 1}, sources={"web": SOURCES["web"]})
    with pytest.raises(DataError, match="draws from source 'code'"):
        dropped.load_state_dict(state)

    # allowed: the shared sources go on where they were, the shares start afresh instead of making up the past
    loader.load_state_dict(state, allow_corpus_change=True)
    assert loader.batch == 10 and loader.state_dict()["consumed"] == {"web": 160, "code": 160, "math": 0}
    counts = np.array([np.bincount(source_of(rows), minlength=3) for rows in run(loader, 50)])
    assert np.all(np.abs(counts.sum(axis=0) - np.array([0.5, 0.3, 0.2]) * 32 * 50) < 1)
    assert loader.last_batch == 59
