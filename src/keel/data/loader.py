"""Global-order loader: the run's data order is a property of the corpus and the seed, not of the layout.

The training split is cut into fixed-length sequences (seq_len + 1 tokens, consecutive sequences
share one boundary token). Epoch e visits them in the order of a permutation seeded by (seed, e).
A global cursor counts sequences consumed; step s consumes global batch s; each data-parallel rank
takes its contiguous slice of the global batch and splits it into micro-batches. The state is
(epoch, cursor, seed, corpus fingerprint, skipped batches), so a run resumed on any number of processes
reads exactly the same global batches.

Global batch b is the one that starts at cursor b × global_batch. Ranges of global batches can be
skipped (a rollback past a poisoned stretch of data, or `data.skip_batches`): the cursor jumps over them.
"""

from __future__ import annotations

import queue
import threading

import numpy as np
import torch

from keel.errors import DataError


class SequenceIndex:
    """Maps a sequence number to its tokens across the shards of one split."""

    def __init__(self, shards: list[np.ndarray], seq_len: int) -> None:
        self.shards, self.seq_len = shards, seq_len
        counts = [max(0, (len(s) - 1) // seq_len) for s in shards]
        self.starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self.count = int(self.starts[-1])
        if self.count == 0:
            raise DataError(f"the split has fewer than {seq_len + 1} tokens: too small for train.seq_len = {seq_len}")

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


class GlobalOrderLoader:
    def __init__(self, shards: list[np.ndarray], *, seq_len: int, global_batch: int, micro_batch: int,
                 dp_rank: int, dp_size: int, seed: int, fingerprint: str, prefetch: int = 2,
                 skips: list[list[int]] | None = None) -> None:
        if global_batch % (micro_batch * dp_size):
            raise ValueError("global_batch must divide by micro_batch × dp_size")
        self.index = SequenceIndex(shards, seq_len)
        self.global_batch, self.micro_batch = global_batch, micro_batch
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.seed, self.fingerprint, self.prefetch = seed, fingerprint, prefetch
        self.cursor = 0  # sequences consumed by the batches handed out so far
        self.skips: list[tuple[int, int]] = []  # [start, end) global batch ranges never handed out
        self.last_batch = -1  # the global batch number of the batch handed out last
        self._perm_epoch, self._perm = -1, np.empty(0, dtype=np.int64)
        self._queue: queue.Queue | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        for start, end in skips or []:
            self.skip(start, end)

    # ------------------------------------------------------------ order

    @property
    def epoch(self) -> int:
        return self.cursor // self.index.count

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.index.count)
            self._perm_epoch = epoch
        return self._perm

    def global_batch_ids(self, cursor: int) -> np.ndarray:
        """Sequence numbers of the global batch that starts at `cursor` (may cross an epoch boundary)."""
        positions = np.arange(cursor, cursor + self.global_batch)
        ids = np.empty(self.global_batch, dtype=np.int64)
        for epoch in np.unique(positions // self.index.count):
            mask = positions // self.index.count == epoch
            ids[mask] = self._permutation(int(epoch))[positions[mask] % self.index.count]
        return ids

    def rank_micro_batches(self, cursor: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's slice of the global batch at `cursor`, as (inputs, targets) micro-batches."""
        per_rank = self.global_batch // self.dp_size
        ids = self.global_batch_ids(cursor)[self.dp_rank * per_rank:(self.dp_rank + 1) * per_rank]
        tokens = torch.from_numpy(self.index.tokens(ids))
        return [(chunk[:, :-1], chunk[:, 1:]) for chunk in tokens.split(self.micro_batch)]

    # ------------------------------------------------------------ iteration with prefetch

    def skip(self, start: int, end: int) -> None:
        """Never hand out global batches start .. end-1."""
        if not 0 <= start < end:
            raise ValueError(f"a skipped range needs 0 <= start < end, not [{start}, {end})")
        merged: list[tuple[int, int]] = []
        for a, b in sorted([*self.skips, (start, end)]):
            if merged and a <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], b))
            else:
                merged.append((a, b))
        self.skips = merged
        if self._thread is not None:  # the prefetched batches may lie in the new range
            self.close()

    def _past_skips(self, cursor: int) -> int:
        for start, end in self.skips:
            if start * self.global_batch <= cursor < end * self.global_batch:
                cursor = end * self.global_batch
        return cursor

    def _produce(self, cursor: int) -> None:
        while not self._stop.is_set():
            cursor = self._past_skips(cursor)
            try:
                batch = self.rank_micro_batches(cursor)
            except BaseException as e:  # handed to the training thread, which raises it
                batch = e
            while not self._stop.is_set():
                try:
                    self._queue.put(batch, timeout=0.1)
                    break
                except queue.Full:
                    continue
            cursor += self.global_batch

    def _start(self) -> None:
        self._stop.clear()
        self._queue = queue.Queue(maxsize=self.prefetch)
        self._thread = threading.Thread(target=self._produce, args=(self.cursor,), daemon=True,
                                        name="keel-data-prefetch")
        self._thread.start()

    def next(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if self._thread is None:
            self._start()
        batch = self._queue.get()
        if isinstance(batch, BaseException):
            self.close()
            raise batch
        self.cursor = self._past_skips(self.cursor) + self.global_batch
        self.last_batch = self.cursor // self.global_batch - 1
        return batch

    def close(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None

    # ------------------------------------------------------------ state

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor, "seed": self.seed, "fingerprint": self.fingerprint,
                "skips": [list(r) for r in self.skips]}

    def load_state_dict(self, state: dict, allow_corpus_change: bool = False) -> None:
        if state["fingerprint"] != self.fingerprint and not allow_corpus_change:
            raise DataError(f"the checkpoint was trained on corpus {state['fingerprint'][:16]}, data.dir holds "
                            f"{self.fingerprint[:16]}; point data.dir at the original corpus or set "
                            f"data.allow_corpus_change=true")
        if state["seed"] != self.seed:
            raise DataError(f"the checkpoint's data order uses seed {state['seed']}, the config says "
                            f"train.seed = {self.seed}; resume with the original seed")
        self.close()
        self.cursor = int(state["cursor"])
        for start, end in state.get("skips", []):
            self.skip(start, end)


def validation_batches(shards: list[np.ndarray], *, seq_len: int, sequences: int, micro_batch: int,
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
