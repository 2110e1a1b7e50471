"""Staging: copy the train state into host buffers that are allocated once and reused by every save.

This copy is the only part of a save the training loop waits for, so it is a plain tensor copy per
entry (pinned memory and non-blocking copies on CUDA) and nothing else. A DTensor keeps its sharding
spec around a host copy of its local shard, which is all DCP needs to write it.
"""

from __future__ import annotations

import copy
from typing import cast

import torch
from torch.distributed.tensor import DTensor


class HostStager:
    def __init__(self, pin_memory: bool) -> None:
        self.pin_memory = pin_memory
        self.staged: dict[tuple[str, str], torch.Tensor] = {}

    def stage(self, state: dict[str, dict]) -> dict[str, dict]:
        """A host copy of a two-level state dict ({"model": {...}, "optim": {...}})."""
        out: dict[str, dict] = {}
        for group, entries in state.items():
            out[group] = {key: self._tensor((group, key), value) if isinstance(value, torch.Tensor)
                          else copy.deepcopy(value) for key, value in entries.items()}
        if self.pin_memory:
            torch.cuda.synchronize()  # the non-blocking device-to-host copies have landed
        return out

    def _tensor(self, key: tuple[str, str], value: torch.Tensor) -> torch.Tensor:
        local = value.to_local() if isinstance(value, DTensor) else value
        holder = self.staged.get(key)
        buffer = holder.to_local() if isinstance(holder, DTensor) else holder
        if holder is None or buffer is None or buffer.shape != local.shape or buffer.dtype != local.dtype:
            buffer = torch.empty(local.shape, dtype=local.dtype, pin_memory=self.pin_memory)
            if isinstance(value, DTensor):
                # Same spec, host storage: what DCP's own stager builds, without its generic traversal.
                if local.device.type == "cpu":
                    holder = DTensor.from_local(buffer, value.device_mesh, value.placements, run_check=False,
                                                shape=value.shape, stride=value.stride())
                else:  # a device mesh: from_local would move the buffer to the device
                    on_host = cast(DTensor, value.detach().to("cpu"))  # a DTensor's copy is a DTensor
                    on_host._local_tensor = buffer
                    holder = on_host
            else:
                holder = buffer
            self.staged[key] = holder
        buffer.copy_(local.detach(), non_blocking=self.pin_memory)
        return holder
