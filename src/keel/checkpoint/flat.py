"""The memory tier's own format: each rank's share of the train state as one file of raw bytes beside an index,
written by that rank alone.

A storage checkpoint is DCP's. Planning it (every rank's items gathered, deduplicated and sent back as pickled
objects) and writing each tensor as a torch.save record hold the interpreter lock for about a second a save of
24M parameters, on the writer thread beside the training loop, which needs the lock between its operators. Here
each rank writes its local shards as they are, one write call a tensor (the lock released for it), and
checksums the bytes as they pass; the index says where in the global tensor each shard lies, so that a restore
with other processes (an elastic job that lost a node) copies into each of its shards the parts of the saved
shards that overlap it, as DCP would.

  flat-rank-RRRRR.bin   the rank's tensors (DTensors: their local shards), each at an offset aligned to ALIGN
  flat-rank-RRRRR.json  each tensor's state-dict group and key, offset in the file, dtype, local shape, global
                        shape and the local shard's offsets in it; the state dict's other values, pickled
"""

from __future__ import annotations

import base64
import json
import math
import os
import pickle
from typing import Any

import torch
import xxhash
from torch.distributed.tensor import DTensor

from keel.checkpoint.storage import Storage
from keel.core.dtensor import local
from keel.core.torch_private import shard_box
from keel.errors import CheckpointError

ALIGN = 64  # bytes: every tensor starts where any dtype may view it
DATA, INDEX = "flat-rank-{rank:05d}.bin", "flat-rank-{rank:05d}.json"


def names(rank: int) -> tuple[str, str]:
    """Rank `rank`'s data and index file."""
    return DATA.format(rank=rank), INDEX.format(rank=rank)


def is_flat(files: dict[str, Any] | list[str]) -> bool:
    """Whether a checkpoint whose files are `files` is in this format."""
    return names(0)[1] in files


def _dtype(t: torch.Tensor) -> str:
    """The dtype's name as the index keeps it ("bfloat16")."""
    return str(t.dtype).removeprefix("torch.")


def _box(value: torch.Tensor) -> tuple[list[int], list[int], list[int]]:
    """The global shape of `value`, and where its local part lies in it (offsets, sizes)."""
    if isinstance(value, DTensor):
        return list(value.shape), *shard_box(value)
    return list(value.shape), [0] * value.dim(), list(value.shape)


def save(storage: Storage, staging: str, state: dict[str, dict], rank: int) -> dict[str, tuple[int, str]]:
    """Write this rank's `state` (a staged two-level state dict) into `staging`. Returns each file written with
    its size and XXH3-128, taken from the bytes as they went out."""
    data, index = names(rank)
    entries, objects, digest, offset = [], {}, xxhash.xxh3_128(), 0
    with open(storage.path(f"{staging}/{data}"), "wb") as f:
        for group, values in state.items():
            for key, value in values.items():
                if not isinstance(value, torch.Tensor):
                    objects[f"{group}\0{key}"] = value
                    continue
                shard = local(value).contiguous()
                pad = -offset % ALIGN
                raw = shard.reshape(-1).view(torch.uint8).numpy().data if shard.numel() else memoryview(b"")
                for chunk in (bytes(pad), raw):
                    f.write(chunk)
                    digest.update(chunk)
                offset += pad
                shape, at, _ = _box(value)
                entries.append([group, key, offset, _dtype(shard), list(shard.shape),
                                shape, at])
                offset += len(raw)
        os.fsync(f.fileno())
    text = json.dumps({"entries": entries, "objects": base64.b64encode(pickle.dumps(objects)).decode()}).encode()
    storage.write_durably(f"{staging}/{index}", text)
    return {data: (offset, digest.hexdigest()), index: (len(text), xxhash.xxh3_128(text).hexdigest())}


class _Saved:
    """The shards a checkpoint holds, by state-dict entry, read from its ranks' files as they are needed."""

    def __init__(self, storage: Storage, name: str, ranks: int, first: int) -> None:
        self.storage, self.name = storage, name
        self.order = [(first + i) % ranks for i in range(ranks)]  # this rank's own file first
        self.indexes = {r: json.loads(storage.read_bytes(f"{name}/{names(r)[1]}")) for r in self.order}
        self.shards: dict[tuple[str, str], list[tuple[int, list]]] = {}
        for r in self.order:
            for entry in self.indexes[r]["entries"]:
                self.shards.setdefault((entry[0], entry[1]), []).append((r, entry))
        self._data: dict[int, torch.Tensor] = {}

    def data(self, rank: int) -> torch.Tensor:
        if rank not in self._data:
            path = self.storage.path(f"{self.name}/{names(rank)[0]}")
            size = os.path.getsize(path)
            self._data[rank] = torch.from_file(path, shared=False, size=size, dtype=torch.uint8) if size else \
                torch.empty(0, dtype=torch.uint8)
        return self._data[rank]

    def piece(self, rank: int, entry: list, dtype: torch.dtype) -> torch.Tensor:
        _, key, offset, _, shape, _, _ = entry
        data, count = self.data(rank), dtype.itemsize * math.prod(shape)
        if offset + count > data.numel():  # read as a file cut short, not as a misfit
            raise ValueError(f"{names(rank)[0]} has {data.numel()} bytes, its index places {key!r} up to "
                             f"{offset + count}")
        return data[offset:offset + count].view(dtype).view(shape)


def load(storage: Storage, name: str, state: dict[str, dict], rank: int, ranks: int) -> None:
    """Copy checkpoint `name`, which `ranks` processes wrote, into `state` (a two-level state dict of the live
    tensors, as `save` was given one): into each tensor the parts of the saved shards that overlap this rank's
    share of it, and the other values as they were saved. Raises CheckpointError where they do not fit: a tensor
    missing on either side, another dtype or global shape, or a part of a shard that no saved shard covers; and
    OSError or ValueError where a file is missing or cut short."""
    saved = _Saved(storage, name, ranks, rank % ranks)
    wanted = {(g, k) for g, values in state.items() for k, v in values.items() if isinstance(v, torch.Tensor)}
    if missing := sorted(set(saved.shards) - wanted):
        raise CheckpointError(f"it holds {missing[0][0]} {missing[0][1]!r}, which this model and optimizer have not")
    if lacking := sorted(wanted - set(saved.shards)):
        raise CheckpointError(f"it lacks {lacking[0][0]} {lacking[0][1]!r} ({len(lacking)} tensors missing)")
    for (group, key), pieces in saved.shards.items():
        target = state[group][key]
        shape, at, sizes = _box(target)
        mine, done, covered = local(target), set(), 0
        for r, entry in pieces:
            dtype, saved_shape, saved_at, saved_sizes = entry[3], entry[5], entry[6], entry[4]
            if dtype != _dtype(mine) or saved_shape != shape:
                raise CheckpointError(f"its {group} {key!r} is {dtype} {saved_shape}, here "
                                      f"{_dtype(mine)} {shape}")
            lo = [max(a, b) for a, b in zip(at, saved_at, strict=True)]
            hi = [min(a + n, b + m) for a, n, b, m in zip(at, sizes, saved_at, saved_sizes, strict=True)]
            if any(low >= high for low, high in zip(lo, hi, strict=True)) or (tuple(lo), tuple(hi)) in done:
                continue  # no overlap, or a replica of a part already copied
            done.add((tuple(lo), tuple(hi)))
            source, into = saved.piece(r, entry, mine.dtype), mine
            for dim, (low, high) in enumerate(zip(lo, hi, strict=True)):
                source = source.narrow(dim, low - saved_at[dim], high - low)
                into = into.narrow(dim, low - at[dim], high - low)
            into.copy_(source)
            covered += math.prod([high - low for low, high in zip(lo, hi, strict=True)])
        if covered != mine.numel():
            raise CheckpointError(f"its shards cover {covered} of the {mine.numel()} elements of {group} {key!r} "
                                  f"on rank {rank}")
    for joined, value in pickle.loads(base64.b64decode(saved.indexes[saved.order[0]]["objects"])).items():
        group, key = joined.split("\0", 1)
        state[group][key] = value
