"""Global-order loader: the global batches depend on the corpus and the seed only, never on the layout.

Shards are np.arange-based, so every token value is unique and a sequence is identified by its
first token; equality is checked on the tokens themselves.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from keel.data.loader import GlobalOrderLoader, SequenceIndex, validation_batches
from keel.errors import DataError

L = 8  # seq_len
GLOBAL, MICRO = 8, 2
FP = "f" * 64
STEPS = 30  # 240 sequences: 14 epochs of 17, with boundaries that fall inside global batches


def make_shards() -> list[np.ndarray]:
    """17 sequences: 10 in the first shard (3 tail tokens left over), none in a shard of only L tokens
    (a sequence needs L + 1), 7 in the last."""
    return [np.arange(0, 10 * L + 1 + 3, dtype=np.uint16),
            np.arange(1000, 1000 + L, dtype=np.uint16),
            np.arange(2000, 2000 + 7 * L + 1, dtype=np.uint16)]


SHARDS = make_shards()
N = 17


def expected_tokens(i: int) -> np.ndarray:
    """Sequence i is tokens [i*L, i*L + L + 1) of its shard, counted from the shard's first sequence."""
    return SHARDS[0][i * L:i * L + L + 1] if i < 10 else SHARDS[2][(i - 10) * L:(i - 10) * L + L + 1]


FIRST_TOKEN_TO_ID = {int(expected_tokens(i)[0]): i for i in range(N)}


def tokens_of(micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Rebuild (rows, L + 1) tokens from (inputs, targets) micro-batches, checking their shape and shift."""
    rows = []
    for x, y in micro_batches:
        assert x.shape == y.shape == (MICRO, L)
        assert torch.equal(x[:, 1:], y[:, :-1])
        rows.append(torch.cat([x, y[:, -1:]], dim=1))
    return torch.cat(rows)


def ids_of(tokens: torch.Tensor) -> list[int]:
    return [FIRST_TOKEN_TO_ID[int(t)] for t in tokens[:, 0]]


@pytest.fixture
def make_loader():
    """Build loaders and always close them, so no prefetch thread outlives its test."""
    made: list[GlobalOrderLoader] = []

    def make(dp_rank: int = 0, dp_size: int = 1, seed: int = 0, fingerprint: str = FP,
             skips: list[list[int]] | None = None) -> GlobalOrderLoader:
        loader = GlobalOrderLoader(SHARDS, seq_len=L, global_batch=GLOBAL, micro_batch=MICRO, dp_rank=dp_rank,
                                   dp_size=dp_size, seed=seed, fingerprint=fingerprint, skips=skips)
        made.append(loader)
        return loader

    yield make
    for loader in made:
        loader.close()


def global_batches(make, dp_size: int, steps: int, seed: int = 0) -> list[torch.Tensor]:
    """The global batch of each step, as the concatenation of every rank's micro-batches in rank order."""
    ranks = [make(r, dp_size, seed) for r in range(dp_size)]
    return [torch.cat([tokens_of(rank.next()) for rank in ranks]) for _ in range(steps)]


def test_sequence_index_maps_to_shard_tokens():
    index = SequenceIndex(SHARDS, L)
    assert index.count == N
    got = index.tokens(np.arange(N))
    assert got.dtype == np.int64 and got.shape == (N, L + 1)
    for i in range(N):
        assert np.array_equal(got[i], expected_tokens(i)), i
    # any order, mixing shards, with repeats
    ids = np.array([16, 0, 10, 9, 3, 10, 15])
    assert np.array_equal(index.tokens(ids), np.stack([expected_tokens(i) for i in ids]))


def test_sequence_index_too_small():
    with pytest.raises(DataError, match="fewer than 9 tokens"):
        SequenceIndex([np.arange(L, dtype=np.uint16)], L)


def test_ranks_concatenate_to_the_single_process_batch(make_loader):
    single = global_batches(make_loader, 1, STEPS)
    r0, r1 = make_loader(0, 2), make_loader(1, 2)
    for step in range(STEPS):
        a, b = r0.next(), r1.next()
        assert len(a) == len(b) == GLOBAL // 2 // MICRO
        ta, tb = tokens_of(a), tokens_of(b)
        assert not torch.equal(ta, tb)
        assert torch.equal(torch.cat([ta, tb]), single[step]), step
    assert r0.epoch == r1.epoch == STEPS * GLOBAL // N


def test_each_epoch_visits_every_sequence_once(make_loader):
    stream = [i for batch in global_batches(make_loader, 1, STEPS) for i in ids_of(batch)]
    epochs = [stream[e * N:(e + 1) * N] for e in range(len(stream) // N)]
    assert len(epochs) == 14
    for order in epochs:
        assert sorted(order) == list(range(N))
    assert epochs[0] != epochs[1]  # each epoch has its own permutation
    # and the tokens are those of the sequences named
    for batch in global_batches(make_loader, 1, 3):
        for row, i in zip(batch, ids_of(batch), strict=True):
            assert np.array_equal(row.numpy(), expected_tokens(i))


def test_seed_sets_the_order(make_loader):
    a = global_batches(make_loader, 1, 4, seed=0)
    again = global_batches(make_loader, 1, 4, seed=0)
    other = global_batches(make_loader, 1, 4, seed=1)
    assert all(torch.equal(x, y) for x, y in zip(a, again, strict=True))
    assert not all(torch.equal(x, y) for x, y in zip(a, other, strict=True))


@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 4), (4, 2)])
def test_resume_with_another_world_size(make_loader, before, after):
    reference = global_batches(make_loader, 1, STEPS)
    k = 5  # cursor 40: in epoch 2, not on an epoch boundary
    first = [make_loader(r, before) for r in range(before)]
    for _ in range(k):
        for rank in first:
            rank.next()
    states = [rank.state_dict() for rank in first]
    assert all(s == states[0] for s in states)
    assert states[0] == {"epoch": 2, "cursor": k * GLOBAL, "seed": 0, "fingerprint": FP,
                         "skips": [], "batch": k, "consumed": {"main": k * GLOBAL},
                         "origin": {"batch": 0, "consumed": {"main": 0}}}

    resumed = [make_loader(r, after) for r in range(after)]
    for rank in resumed:
        rank.load_state_dict(dict(states[0]))
    for step in range(k, STEPS):
        got = torch.cat([tokens_of(rank.next()) for rank in resumed])
        assert torch.equal(got, reference[step]), step


def test_load_state_into_a_running_loader(make_loader):
    # the prefetch thread has already read ahead; loading a state must discard what it queued
    reference = global_batches(make_loader, 1, 12)
    loader = make_loader()
    for _ in range(6):
        loader.next()
    loader.load_state_dict({"epoch": 0, "cursor": 2 * GLOBAL, "seed": 0, "fingerprint": FP})
    for step in range(2, 12):
        assert torch.equal(tokens_of(loader.next()), reference[step]), step


def test_fingerprint_mismatch(make_loader):
    reference = global_batches(make_loader, 1, 4)
    loader = make_loader()
    state = {"epoch": 1, "cursor": 3 * GLOBAL, "seed": 0, "fingerprint": "0" * 64}
    with pytest.raises(DataError, match="allow_corpus_change"):
        loader.load_state_dict(state)
    assert loader.cursor == 0 and torch.equal(tokens_of(loader.next()), reference[0])
    loader.load_state_dict(state, allow_corpus_change=True)
    assert loader.cursor == 3 * GLOBAL and torch.equal(tokens_of(loader.next()), reference[3])


def test_seed_mismatch(make_loader):
    loader = make_loader(seed=0)
    state = {"epoch": 0, "cursor": GLOBAL, "seed": 1, "fingerprint": FP}
    for allow in (False, True):  # allowing a corpus change does not allow another order
        with pytest.raises(DataError, match="seed"):
            loader.load_state_dict(state, allow_corpus_change=allow)
        assert loader.cursor == 0


def test_close_stops_prefetch_thread(make_loader):
    reference = global_batches(make_loader, 1, 3)
    loader = make_loader()
    loader.close()  # never started: nothing to stop
    assert torch.equal(tokens_of(loader.next()), reference[0])
    thread = loader._thread
    assert thread is not None and thread.is_alive()
    loader.close()
    assert not thread.is_alive()
    # closing is not the end: the next batch restarts the thread at the right place
    assert torch.equal(tokens_of(loader.next()), reference[1])
    thread = loader._thread
    loader.close()
    assert not thread.is_alive()


def test_global_batch_must_divide():
    with pytest.raises(ValueError, match="divide"):
        GlobalOrderLoader(SHARDS, seq_len=L, global_batch=8, micro_batch=3, dp_rank=0, dp_size=1, seed=0,
                          fingerprint=FP)


@pytest.mark.parametrize(("shards", "sequences", "expected"), [
    (SHARDS, 8, 8),
    (SHARDS, 16, 16),
])
def test_validation_set_is_the_same_for_every_layout(shards, sequences, expected):
    index = SequenceIndex(shards, L)
    want = torch.from_numpy(index.tokens(np.arange(expected)))
    for dp_size in (1, 2, 4):
        per_rank = [validation_batches(shards, seq_len=L, sequences=sequences, micro_batch=MICRO, dp_rank=r,
                                       dp_size=dp_size) for r in range(dp_size)]
        assert all(len(mbs) == expected // dp_size // MICRO for mbs in per_rank)
        got = torch.cat([tokens_of(mbs) for mbs in per_rank])
        assert torch.equal(got, want), dp_size


def test_validation_split_smaller_than_the_set_is_refused():
    """Capping the set at the split's size would make it depend on the process count; refuse instead."""
    shards = [np.arange(6 * L + 1, dtype=np.uint16)]
    with pytest.raises(DataError, match="fewer than eval.sequences = 8"):
        validation_batches(shards, seq_len=L, sequences=8, micro_batch=MICRO, dp_rank=0, dp_size=1)


def test_a_failing_read_in_the_prefetch_thread_is_raised_by_next():
    loader = GlobalOrderLoader(SHARDS, seq_len=L, global_batch=4, micro_batch=2, dp_rank=0, dp_size=1, seed=0,
                               fingerprint=FP)
    loader.next()

    def broken(cursor: int):
        raise OSError("disk read failed")

    loader.close()
    loader.rank_micro_batches = broken
    with pytest.raises(OSError, match="disk read failed"):
        loader.next()
    assert loader._thread is None, "the loader stops its thread after the failure"
    assert loader.cursor == 4, "a failed read consumes nothing"


def test_validation_too_small_for_the_layout():
    with pytest.raises(DataError, match="fewer than"):
        validation_batches([np.arange(2 * L + 1, dtype=np.uint16)], seq_len=L, sequences=8, micro_batch=1,
                           dp_rank=0, dp_size=4)


def test_skipped_batches_are_never_handed_out_and_the_skips_resume(make_loader) -> None:
    plain = make_loader()
    every = [tokens_of(plain.next()) for _ in range(12)]  # global batches 0..11
    skipping = make_loader()
    skipping.skip(3, 5)
    skipping.skip(4, 7)  # overlapping ranges merge
    assert skipping.skips == [(3, 7)]
    got = [tokens_of(skipping.next()) for _ in range(3)]
    assert skipping.last_batch == 2
    got.append(tokens_of(skipping.next()))
    assert skipping.last_batch == 7, "batches 3..6 are jumped over"
    assert all(torch.equal(a, b) for a, b in zip(got, every[:3] + [every[7]], strict=True))

    state = skipping.state_dict()
    assert state["skips"] == [[3, 7]] and state["cursor"] == 8 * GLOBAL
    resumed = make_loader()
    resumed.load_state_dict(state)
    assert torch.equal(tokens_of(resumed.next()), every[8])
    resumed.skip(9, 11)  # a skip added while batches are prefetched drops them
    assert torch.equal(tokens_of(resumed.next()), every[11])


def test_skips_from_the_config_apply_from_the_start(make_loader) -> None:
    plain = make_loader()
    every = [tokens_of(plain.next()) for _ in range(3)]
    loader = make_loader(skips=[[0, 2]])
    assert torch.equal(tokens_of(loader.next()), every[2])
    with pytest.raises(ValueError, match="start < end"):
        loader.skip(5, 5)
