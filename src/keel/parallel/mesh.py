"""The process group. Every run has one, a one-process run included, so that the trainer and checkpoints take one
code path (the device mesh over it is keel.parallel.layout's)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from keel.core import generations
from keel.errors import ConfigError


@dataclass(frozen=True)
class Dist:
    rank: int
    world_size: int
    device: torch.device


def pick_device(choice: str) -> torch.device:
    if choice == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device = 'cuda' but this machine has no usable CUDA device (or torch is a CPU "
                          "build); use train.device=auto or cpu")
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def init_distributed(device: torch.device, generation: int = 0) -> Dist:
    """Join the job torchrun started, or form a one-process group when run directly. A `generation` after the
    first is the group re-formed with a replaced rank (keel.core.generations)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    if generation:
        dist.init_process_group(backend, store=generations.group_store(generation), rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]),
                                device_id=device if device.type == "cuda" else None)
    elif "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return Dist(dist.get_rank(), dist.get_world_size(), device)


def destroy_distributed(wait_for_peers: bool = True, timeout_s: float = 30.0) -> None:
    """Leave the process group. Every rank first waits for the others, so that none tears down its
    connections while a peer is still finishing a collective (gloo aborts the peer then). After a
    crash the peers may be gone: leave without waiting. On gloo the wait is bounded, for errors that
    all ranks should have met but one did not."""
    if not dist.is_initialized():
        return
    if wait_for_peers:
        try:
            if dist.get_backend() == "gloo":
                dist.monitored_barrier(timeout=timedelta(seconds=timeout_s))
            else:
                dist.barrier()
        except RuntimeError:
            pass  # a peer never arrived: leave anyway
    dist.destroy_process_group()
