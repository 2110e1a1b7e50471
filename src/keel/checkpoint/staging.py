"""Staging: copy the train state into host buffers that are allocated once and reused by every save,
while training goes on.

A save starts the copy and returns; the loop waits for it only at the fence, just before the next
optimizer update (the first thing to change the tensors being copied): the forward and backward of the
next step run beside the copy. On CPU the copy runs on a worker thread; on CUDA on a side stream, into
pinned memory, and the fence makes the compute stream wait for it without blocking the host. The buffers
can be allocated and touched ahead of the first save (`reserve`), so that it costs what the later ones
cost. A DTensor keeps its sharding spec around a host copy of its local shard, which is all DCP needs to
write it.
"""

from __future__ import annotations

import copy
import os
import threading
import time
from collections import defaultdict
from concurrent.futures import Future
from typing import Any, cast

import torch
from torch.distributed.tensor import DTensor

from keel.core.dtensor import local
from keel.core.process import in_background
from keel.core.torch_private import copy_all_, pin_by_registering, set_local_tensor

Signature = tuple[Any, ...]


def _signature(value: torch.Tensor) -> Signature:
    """What a host holder must share with a tensor to stage it: the local shard's shape and dtype, and a
    DTensor's global shape, placements and mesh."""
    shard = local(value)
    if isinstance(value, DTensor):
        return (tuple(shard.shape), shard.dtype, tuple(value.shape), value.placements, id(value.device_mesh))
    return tuple(shard.shape), shard.dtype


class Staging:
    """One save's copy in flight: `state` is its host state dict, whose tensors are complete once
    `wait_copied` returns."""

    def __init__(self, state: dict[str, dict], copied: Future[None] | None, event: Any, started: float) -> None:
        self.state, self._copied, self._event, self.started = state, copied, event, started
        self.fenced = threading.Event()  # the loop has passed the fence: its wait there is known
        self.fence_s = 0.0  # how long the loop waited at the fence
        self.copy_s = 0.0  # start → the host copy complete, as the worker saw it (CPU)

    def fence(self) -> None:
        """Make what comes next wait for the copy to have read the live tensors (once per save)."""
        if self.fenced.is_set():
            return
        started = time.perf_counter()
        if self._copied is not None:
            self._copied.result()
        elif self._event is not None:
            torch.cuda.current_stream().wait_event(self._event)  # the device waits; the host goes on
        self.fence_s = time.perf_counter() - started
        self.fenced.set()

    def wait_copied(self) -> None:
        """Block until the host buffers hold the whole state (the writer's side)."""
        if self._copied is not None:
            self._copied.result()
        elif self._event is not None:
            self._event.synchronize()


class HostStager:
    def __init__(self, pin_memory: bool) -> None:
        self.pin_memory = pin_memory
        self.staged: dict[tuple[str, str], torch.Tensor] = {}  # holders by state-dict entry
        self.spare: dict[Signature, list[torch.Tensor]] = defaultdict(list)  # reserved, not yet given an entry
        self._reserving: Future[None] | None = None
        self._stream = torch.cuda.Stream() if pin_memory else None
        if pin_memory:  # a save's tens of GB of holders: their pages mapped by up to 16 threads
            pin_by_registering(threads=min(16, os.cpu_count() or 1))

    def reserve(self, templates: list[torch.Tensor]) -> None:
        """Allocate and touch, in the background, one holder like each template: the first save then
        finds its buffers ready instead of allocating them while the loop waits."""
        def allocate() -> None:
            for t in templates:
                holder, buffer = self._new_holder(t)
                if not self.pin_memory:  # pinned pages are resident once allocated; pageable ones at first touch
                    buffer.zero_()
                self.spare[_signature(t)].append(holder)

        self._reserving = in_background(allocate, "keel-staging-reserve")

    def start(self, state: dict[str, dict]) -> Staging:
        """Begin copying a two-level state dict ({"model": {...}, "optim": {...}}) to the host. Values
        other than tensors are copied at once: they may change before the fence (the learning rate)."""
        started = time.perf_counter()
        if self._reserving is not None:
            self._reserving.result()
            self._reserving = None
        out: dict[str, dict] = {}
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        for group, entries in state.items():
            out[group] = {}
            for key, value in entries.items():
                if isinstance(value, torch.Tensor):
                    holder = out[group][key] = self._holder((group, key), value)
                    pairs.append((local(holder), local(value).detach()))
                else:
                    out[group][key] = copy.deepcopy(value)
        if self._stream is not None:
            self._stream.wait_stream(torch.cuda.current_stream())  # the update that made this state is done
            with torch.cuda.stream(self._stream):
                copy_all_([b for b, _ in pairs], [s for _, s in pairs], non_blocking=True)
                event = torch.cuda.Event()
                event.record()
            return Staging(out, None, event, started)
        staging = Staging(out, None, None, started)
        staging._copied = in_background(lambda: self._copy(pairs, staging), "keel-staging")
        return staging

    @staticmethod
    def _copy(pairs: list[tuple[torch.Tensor, torch.Tensor]], staging: Staging) -> None:
        # One call for every tensor: the interpreter lock is released once for the whole copy, rather than
        # taken back from the training thread between tensors (up to a switch interval each time).
        copy_all_([b for b, _ in pairs], [s for _, s in pairs])
        staging.copy_s = time.perf_counter() - staging.started

    def _holder(self, key: tuple[str, str], value: torch.Tensor) -> torch.Tensor:
        """The entry's host holder: its own from the last save, a reserved one, or a new one."""
        signature = _signature(value)
        holder = self.staged.get(key)
        if holder is None or _signature(holder) != signature:
            spare = self.spare.get(signature)
            holder = spare.pop() if spare else self._new_holder(value)[0]
            self.staged[key] = holder
        return holder

    def _new_holder(self, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A host holder shaped like `value` (a DTensor with the same spec for a DTensor) and its buffer."""
        shard = local(value)
        buffer = torch.empty(shard.shape, dtype=shard.dtype, pin_memory=self.pin_memory)
        if not isinstance(value, DTensor):
            return buffer, buffer
        if shard.device.type == "cpu":
            # Same spec, host storage: what DCP's own stager builds, without its generic traversal.
            return DTensor.from_local(buffer, value.device_mesh, value.placements, run_check=False,
                                      shape=value.shape, stride=value.stride()), buffer
        # A device mesh: from_local would move the buffer to the device; a DTensor's host copy keeps its spec.
        on_host = cast(DTensor, value.detach().to("cpu"))
        set_local_tensor(on_host, buffer)
        return on_host, buffer
