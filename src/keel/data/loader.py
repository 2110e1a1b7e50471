"""Global-order loader: the run's data order is a property of the corpus and the seed, not of the layout.

Each named source's training split is cut into fixed-length sequences (seq_len + 1 tokens, consecutive
sequences share one boundary token). Source i visits its sequences epoch after epoch, each epoch in the
order of a permutation seeded by (seed, the source's name, epoch), so a source's order does not depend on
its position among the others; a per-source cursor counts the sequences it has supplied so far.

Global batch b (counted from 0; step s of an uninterrupted run trains on batch s - 1) holds global_batch
sequences. How many come from each source follows a deficit rule: by the end of batch b, source i should
have supplied expected_i = sum over batches k <= b of w_i(k) × global_batch sequences, where w(k) are the
normalised weights of the mixture phase that batch k falls in (the last phase whose first batch is <= k).
Each source gets the whole part of what it is owed (never less than nothing, nothing at weight 0), and
the seats left over go to the sources whose fractional part would soonest reach a whole sequence, so with
constant weights no source drifts a whole sequence from its share (after a change of weights, for a few
batches, a little more). The composition is a function of (b, per-source cursors) only, and its positions
in the batch are shuffled with a permutation seeded by (seed, b) so that every rank's slice mixes the
sources. A mixture phase that starts at step s applies to global batches s and later, that is to the
optimizer steps made after s steps, as the learning-rate schedule counts them; skipped batches count.

Each data-parallel rank takes its contiguous slice of the global batch and splits it into micro-batches.
The state is (next batch, per-source cursors, seed, corpus fingerprint, skipped batches), so a run resumed
on any number of processes reads exactly the same global batches. A resume onto other sources (allowed by
data.allow_corpus_change) keeps the cursors of the sources still there and starts the shares afresh from
that batch rather than making up the past. A skipped range of global batches (a
rollback past a poisoned stretch of data, or `data.skip_batches`) is consumed by the bookkeeping only: the
cursors advance as if its batches had been read, no token is loaded.

A corpus of one source keeps the single-split order: epoch e is the permutation seeded by (seed, e) and
global batch b is sequences [b × global_batch, (b + 1) × global_batch) of the concatenated epochs.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import queue
import threading
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import numpy as np
import torch

from keel.errors import DataError

MAIN = "main"  # the name of the one source of a corpus given as a plain list of shards
_ROUNDING = 1e-6  # float64 error of expected counts up to ~10^9 sequences stays far below this


class SequenceIndex:
    """Maps a sequence number to its tokens across the shards of one split."""

    def __init__(self, shards: Sequence[np.ndarray], seq_len: int, what: str = "the split") -> None:
        self.shards, self.seq_len = shards, seq_len
        counts = [max(0, (len(s) - 1) // seq_len) for s in shards]
        self.starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self.count = int(self.starts[-1])
        if self.count == 0:
            raise DataError(f"{what} has fewer than {seq_len + 1} tokens: too small for train.seq_len = {seq_len}")

    def tokens(self, ids: np.ndarray) -> np.ndarray:
        """(len(ids), seq_len + 1) int64 tokens."""
        out = np.empty((len(ids), self.seq_len + 1), dtype=np.int64)
        shard_of = np.searchsorted(self.starts, ids, side="right") - 1
        offsets = np.arange(self.seq_len + 1)
        for shard in np.unique(shard_of):
            rows = np.nonzero(shard_of == shard)[0]
            first = (ids[rows] - self.starts[shard]) * self.seq_len
            out[rows] = self.shards[shard][first[:, None] + offsets]
        return out


class Mixture:
    """Which share of every global batch each source supplies, phase by phase, and the deficit rule
    that turns the shares into whole sequence counts."""

    def __init__(self, names: list[str], weights: dict[str, float] | None,
                 schedule: Sequence[tuple[int, dict[str, float]]], global_batch: int) -> None:
        self.names, self.global_batch = names, global_batch
        phases = sorted(((int(step), w) for step, w in schedule), key=lambda p: p[0])
        steps = [step for step, _ in phases]
        if any(step < 0 for step in steps) or len(set(steps)) != len(steps):
            raise DataError(f"the mixture schedule's steps must be distinct and >= 0, not {steps}")
        if not phases or phases[0][0] > 0:  # the base weights hold until the first scheduled change
            phases.insert(0, (0, weights if weights is not None else dict.fromkeys(names, 1.0)))
        self.starts = [step for step, _ in phases]
        self.weights = [self._normalised(w, step) for step, w in phases]

    def _normalised(self, weights: dict[str, float], step: int) -> list[float]:
        where = "data.sources weights" if step == 0 else f"the weights of the mixture phase at step {step}"
        for name, w in weights.items():
            if name not in self.names:
                raise DataError(f"{where} name source '{name}', which the corpus does not have; the sources are "
                                f"{', '.join(self.names)}")
            if not math.isfinite(w) or w < 0:
                raise DataError(f"{where} give source '{name}' the weight {w}; a weight is a finite number >= 0")
        raw = [float(weights.get(name, 0.0)) for name in self.names]
        total = math.fsum(raw)
        if total <= 0:
            raise DataError(f"{where} are all 0; give at least one of {', '.join(self.names)} a weight > 0")
        return [w / total for w in raw]

    def weights_at(self, batch: int) -> list[float]:
        """The normalised weights global batch `batch` is drawn with."""
        phase = 0
        while phase + 1 < len(self.starts) and self.starts[phase + 1] <= batch:
            phase += 1
        return self.weights[phase]

    def expected(self, origin: int, end: int) -> list[float]:
        """Sequences each source should supply to global batches origin .. end-1: a closed form over the
        phases (never a running sum), so every process and every resume computes the same float64 values."""
        owed = [0.0] * len(self.names)
        bounds = [*self.starts[1:], max(end, self.starts[-1])]
        for first, last, weights in zip(self.starts, bounds, self.weights, strict=True):
            batches = min(last, end) - max(first, origin)
            if batches > 0:
                owed = [o + w * (batches * self.global_batch) for o, w in zip(owed, weights, strict=True)]
        return owed

    def counts(self, batch: int, drawn: Sequence[int], origin: int) -> list[int]:
        """Sequences of each source in global batch `batch`, given what each has supplied since batch
        `origin`: the whole part of what it is owed, then one more each for the sources whose remainder
        would soonest reach a whole sequence (ties: the larger remainder, then the earlier source) until
        the counts fill the batch. A source that weighs 0 in this batch's phase supplies nothing; a source
        owed less than nothing supplies nothing."""
        weights = self.weights_at(batch)
        owed = [e - d for e, d in zip(self.expected(origin, batch + 1), drawn, strict=True)]
        counts = [max(0, math.floor(o)) if w > 0 else 0 for o, w in zip(owed, weights, strict=True)]
        spare = [o - c for o, c in zip(owed, counts, strict=True)]
        short = self.global_batch - sum(counts)
        drawable = [i for i, w in enumerate(weights) if w > 0]
        # Giving the extra seats to the largest remainders lets a source with a small share take one early
        # and leave the others short for long; serving the nearest deadline first (as in proportionate-fair
        # scheduling) keeps every source within one sequence of its share. A source whose remainder is
        # (up to rounding) nothing is not served early: that would put it a whole sequence ahead.
        rate = [w * self.global_batch % 1.0 for w in weights]

        def deadline(k: int) -> tuple[float, float, int]:
            return ((1.0 - spare[k]) / rate[k] if rate[k] > 0 else math.inf, -spare[k], k)

        while short > 0:  # |short| < number of sources unless a state was rebased far from its shares
            due = [k for k in drawable if spare[k] > _ROUNDING] or drawable
            i = min(due, key=deadline)
            counts[i], spare[i], short = counts[i] + 1, spare[i] - 1, short - 1
        while short < 0:
            i = min((k for k in drawable if counts[k] > 0), key=lambda k: (spare[k], -k))
            counts[i], spare[i], short = counts[i] - 1, spare[i] + 1, short + 1
        return counts


class BatchPlan(NamedTuple):
    """One global batch: its number, each source's cursor before it, and each source's sequence count."""
    number: int
    before: tuple[int, ...]
    counts: tuple[int, ...]


# What the prefetch thread hands the training thread: a batch and its plan, or the error that ended the thread.
Prefetched = tuple[BatchPlan, list[tuple[torch.Tensor, torch.Tensor]]] | tuple[None, BaseException]


def _source_key(name: str) -> int:
    """A stable integer for a source name, so that a source's order does not depend on its position."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")


class GlobalOrderLoader:
    def __init__(self, sources: Mapping[str, Sequence[np.ndarray]] | Sequence[np.ndarray], *,
                 weights: dict[str, float] | None = None,
                 schedule: Sequence[tuple[int, dict[str, float]]] = (), seq_len: int, global_batch: int,
                 micro_batch: int, dp_rank: int, dp_size: int, seed: int, fingerprint: str, prefetch: int = 2,
                 skips: list[list[int]] | None = None) -> None:
        """`sources`: name → training shards (a plain list is one source, 'main'); `weights`: name →
        weight, normalised (None: equal); `schedule`: (first global batch, weights) phases."""
        if global_batch % (micro_batch * dp_size):
            raise ValueError("global_batch must divide by micro_batch × dp_size")
        if not isinstance(sources, Mapping):
            sources = {MAIN: sources}
        if not sources:
            raise DataError("the corpus has no training source; prepare one with `keel data prepare`")
        self.names = list(sources)
        self.indexes = [SequenceIndex(shards, seq_len, f"the training split of source '{name}'")
                        for name, shards in sources.items()]
        self.mixture = Mixture(self.names, weights, schedule, global_batch)
        self.seq_len, self.global_batch, self.micro_batch = seq_len, global_batch, micro_batch
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.seed, self.fingerprint, self.prefetch = seed, fingerprint, prefetch
        self.batch = 0  # the next global batch number
        self.cursor = 0  # sequences consumed by the batches handed out or skipped so far, all sources together
        self.consumed = [0] * len(self.names)  # each source's cursor
        # The deficit rule counts from here: (batch, cursors); moved only when a resume changes the sources.
        self.origin: tuple[int, list[int]] = (0, [0] * len(self.names))
        self.skips: list[tuple[int, int]] = []  # [start, end) global batch ranges never handed out
        self.last_batch = -1  # the global batch number of the batch handed out last
        self.last_counts = [0] * len(self.names)  # its sequences per source
        self._perms: list[tuple[int, np.ndarray]] = [(-1, np.empty(0, dtype=np.int64))] * len(self.names)
        self._queue: queue.Queue[Prefetched] = queue.Queue(prefetch)  # each start makes its own
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        for start, end in skips or []:
            self.skip(start, end)

    # ------------------------------------------------------------ order

    @property
    def epoch(self) -> int:
        """The epoch of the source furthest through its data (the only source's epoch for one source)."""
        return max(self.epochs().values())

    def epochs(self) -> dict[str, int]:
        return {name: c // index.count for name, c, index in zip(self.names, self.consumed, self.indexes, strict=True)}

    def tokens_by_source(self) -> dict[str, int]:
        """Tokens each source has supplied (skipped batches included: their data is used up too)."""
        return {name: c * self.seq_len for name, c in zip(self.names, self.consumed, strict=True)}

    def last_batch_sources(self) -> dict[str, int]:
        """Sequences of each source in the global batch handed out last."""
        return dict(zip(self.names, self.last_counts, strict=True))

    def weights_at(self, batch: int) -> dict[str, float]:
        return dict(zip(self.names, self.mixture.weights_at(batch), strict=True))

    def _permutation(self, source: int, epoch: int) -> np.ndarray:
        cached_epoch, perm = self._perms[source]  # one tuple: read and replaced whole, safe across threads
        if cached_epoch != epoch:
            key = [self.seed, epoch] if len(self.names) == 1 else [self.seed, _source_key(self.names[source]), epoch]
            perm = np.random.default_rng(key).permutation(self.indexes[source].count)
            self._perms[source] = (epoch, perm)
        return perm

    def _stream(self, source: int, start: int, n: int) -> np.ndarray:
        """Sequence numbers at positions start .. start+n-1 of a source's epochs (may cross epoch boundaries)."""
        count = self.indexes[source].count
        positions = np.arange(start, start + n)
        ids = np.empty(n, dtype=np.int64)
        for epoch in np.unique(positions // count):
            mask = positions // count == epoch
            ids[mask] = self._permutation(source, int(epoch))[positions[mask] % count]
        return ids

    def plan(self, number: int, before: Sequence[int]) -> BatchPlan:
        drawn = [c - o for c, o in zip(before, self.origin[1], strict=True)]
        counts = self.mixture.counts(number, drawn, self.origin[0]) if len(self.names) > 1 else [self.global_batch]
        return BatchPlan(number, tuple(before), tuple(counts))

    def global_batch_ids(self, plan: BatchPlan) -> tuple[np.ndarray, np.ndarray]:
        """(source, sequence number) of each sequence of a global batch, in batch order."""
        sources = np.repeat(np.arange(len(self.names)), plan.counts)
        ids = np.concatenate([self._stream(i, start, n)
                              for i, (start, n) in enumerate(zip(plan.before, plan.counts, strict=True))])
        if len(self.names) > 1:
            order = np.random.default_rng([self.seed, plan.number]).permutation(self.global_batch)
            sources, ids = sources[order], ids[order]
        return sources, ids

    def rank_micro_batches(self, plan: BatchPlan) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's slice of a global batch, as (inputs, targets) micro-batches."""
        per_rank = self.global_batch // self.dp_size
        sources, ids = self.global_batch_ids(plan)
        mine = slice(self.dp_rank * per_rank, (self.dp_rank + 1) * per_rank)
        sources, ids = sources[mine], ids[mine]
        out = np.empty((per_rank, self.seq_len + 1), dtype=np.int64)
        for source in np.unique(sources):
            rows = sources == source
            out[rows] = self.indexes[source].tokens(ids[rows])
        tokens = torch.from_numpy(out)
        return [(chunk[:, :-1], chunk[:, 1:]) for chunk in tokens.split(self.micro_batch)]

    def share(self, rank: int, size: int) -> None:
        """Take slice `rank` of `size` of every later global batch (the data-parallel ranks of the live
        replica groups, when some are missing): the batches read ahead for another slice are dropped."""
        if self.global_batch % (self.micro_batch * size) or not 0 <= rank < size:
            raise ValueError(f"slice {rank} of {size}: global_batch {self.global_batch} does not split into "
                             f"micro-batches of {self.micro_batch} that way")
        if (rank, size) != (self.dp_rank, self.dp_size):
            self.close()
            self.dp_rank, self.dp_size = rank, size

    # ------------------------------------------------------------ iteration with prefetch

    def skip(self, start: int, end: int) -> None:
        """Never hand out global batches start .. end-1."""
        if not 0 <= start < end:
            raise ValueError(f"a skipped range needs 0 <= start < end, not [{start}, {end})")
        self.close()  # the prefetched batches may lie in the new range
        merged: list[tuple[int, int]] = []
        for a, b in sorted([*self.skips, (start, end)]):
            if merged and a <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], b))
            else:
                merged.append((a, b))
        self.skips = merged

    def _past_skips(self, number: int, consumed: list[int], skips: list[tuple[int, int]]) -> tuple[int, list[int]]:
        """Advance the cursors over skipped batches: bookkeeping only, no token is read."""
        for start, end in skips:
            if start <= number < end:
                if len(self.names) == 1:
                    consumed = [consumed[0] + (end - number) * self.global_batch]
                else:
                    for b in range(number, end):
                        consumed = [c + n for c, n in zip(consumed, self.plan(b, consumed).counts, strict=True)]
                number = end
        return number, consumed

    def _produce(self, number: int, consumed: list[int], skips: list[tuple[int, int]]) -> None:
        while not self._stop.is_set():
            try:
                number, consumed = self._past_skips(number, consumed, skips)
                plan = self.plan(number, consumed)
                item: Prefetched = (plan, self.rank_micro_batches(plan))
            except BaseException as e:  # handed to the training thread, which raises it
                item = (None, e)
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if item[0] is None:
                return
            consumed = [c + n for c, n in zip(consumed, plan.counts, strict=True)]
            number += 1

    def _start(self) -> None:
        self._stop.clear()
        self._queue = queue.Queue(self.prefetch)
        # The thread works on copies: next() updates the loader's own state from what the thread hands over.
        self._thread = threading.Thread(target=self._produce, args=(self.batch, list(self.consumed),
                                                                    list(self.skips)),
                                        daemon=True, name="keel-data-prefetch")
        self._thread.start()

    def next(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if self._thread is None:
            self._start()
        item = self._queue.get()
        if item[0] is None:
            self.close()
            raise item[1]
        plan, batch = item
        self.cursor += (plan.number + 1 - self.batch) * self.global_batch
        self.batch = plan.number + 1
        self.consumed = [c + n for c, n in zip(plan.before, plan.counts, strict=True)]
        self.last_batch, self.last_counts = plan.number, list(plan.counts)
        return batch

    def close(self) -> None:
        if self._thread is not None:
            self._stop.set()
            # A prefetcher waiting for room takes the room made here and sees the stop at once.
            with contextlib.suppress(queue.Empty):
                while True:
                    self._queue.get_nowait()
            self._thread.join()
            self._thread = None

    # ------------------------------------------------------------ state

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor, "seed": self.seed, "fingerprint": self.fingerprint,
                "skips": [list(r) for r in self.skips], "batch": self.batch,
                "consumed": dict(zip(self.names, self.consumed, strict=True)),
                "origin": {"batch": self.origin[0], "consumed": dict(zip(self.names, self.origin[1], strict=True))}}

    def load_state_dict(self, state: dict, allow_corpus_change: bool = False) -> None:
        if state["fingerprint"] != self.fingerprint and not allow_corpus_change:
            raise DataError(f"the checkpoint was trained on corpus {state['fingerprint'][:16]}, data.dir holds "
                            f"{self.fingerprint[:16]}; point data.dir at the original corpus or set "
                            f"data.allow_corpus_change=true")
        if state["seed"] != self.seed:
            raise DataError(f"the checkpoint's data order uses seed {state['seed']}, the config says "
                            f"train.seed = {self.seed}; resume with the original seed")
        cursor = int(state["cursor"])
        number = int(state.get("batch", cursor // self.global_batch))
        saved = state.get("consumed")
        if saved is None:  # a state from before sources had names: one source, whose cursor is the cursor
            saved = {self.names[0]: cursor} if len(self.names) == 1 else {}
        new = [name for name in self.names if name not in saved]
        gone = [name for name in saved if name not in self.names]
        if (new or gone) and not allow_corpus_change:
            known = ", ".join(saved) or "none recorded"
            problem = (f"the corpus has source '{new[0]}', which the checkpoint's data order does not know" if new
                       else f"the checkpoint's data order draws from source '{gone[0]}', which the corpus lacks")
            raise DataError(f"{problem} (the checkpoint's sources: {known}); resume with the same sources or set "
                            f"data.allow_corpus_change=true")
        consumed = [int(saved.get(name, 0)) for name in self.names]
        origin = state.get("origin") or {"batch": 0, "consumed": {}}
        origin_at = int(origin["batch"])
        origin_consumed = [int(origin["consumed"].get(name, 0)) for name in self.names]
        drawn = sum(consumed) - sum(origin_consumed)
        if new or gone or drawn != (number - origin_at) * self.global_batch:
            # Other sources or another batch size: the shares start afresh here rather than make up the past.
            origin_at, origin_consumed = number, list(consumed)
        self.close()
        self.batch, self.cursor, self.consumed = number, cursor, consumed
        self.origin = (origin_at, origin_consumed)
        for start, end in state.get("skips", []):
            self.skip(start, end)


def validation_batches(shards: Sequence[np.ndarray], *, seq_len: int, sequences: int, micro_batch: int,
                       dp_rank: int, dp_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A fixed validation set: the first `sequences` sequences of the validation split, shared out in
    equal contiguous slices (`sequences` divides by `dp_size`), so every layout measures the same set."""
    index = SequenceIndex(shards, seq_len)
    if index.count < sequences:
        raise DataError(f"the validation split holds {index.count} sequences of {seq_len + 1} tokens, fewer than "
                        f"eval.sequences = {sequences}; lower eval.sequences or raise data.val_fraction")
    per_rank = sequences // dp_size
    ids = np.arange(dp_rank * per_rank, (dp_rank + 1) * per_rank)
    tokens = torch.from_numpy(index.tokens(ids))
    return [(chunk[:, :-1], chunk[:, 1:]) for chunk in tokens.split(micro_batch)]
