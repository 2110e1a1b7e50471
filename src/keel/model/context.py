"""What a model needs of context parallelism (keel.parallel.context implements it): which positions of each
sequence this rank computes, attention over the whole sequence's keys from this rank's queries, and the whole
sequence of what every rank computed at its positions."""

from __future__ import annotations

from typing import Protocol

import torch


class ContextParallel(Protocol):
    size: int  # ranks the sequence is split over

    def positions(self, seq_len: int, device: torch.device | None = None) -> torch.Tensor:
        """This rank's positions of a sequence of `seq_len` tokens, ascending."""
        ...

    def split(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """`x`'s entries at this rank's positions along `dim`."""
        ...

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """(batch, heads, local, d) of every rank of the group → (batch, heads, seq, d) in sequence order (a
        collective: every rank of the group calls it)."""
        ...

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, query_docs: torch.Tensor | None = None,
                  key_docs: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
        """Causal attention (within documents, given each position's document) of this rank's queries over the
        whole sequence's keys and values, of which this rank holds its positions'."""
        ...
