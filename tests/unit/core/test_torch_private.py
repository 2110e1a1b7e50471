"""Each private torch API keel calls still exists in the installed torch and does what keel relies on; no other
module of keel names a private torch API."""

from __future__ import annotations

import re
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from keel.core import torch_private
from keel.core.torch_private import (
    checkpoint_wrapper,
    copy_all_,
    default_store,
    fsspec_checkpoint_io,
    in_backward,
    norms,
    process_groups,
    set_group_timeout,
    set_local_tensor,
)
from keel.parallel.mesh import destroy_distributed, init_distributed
from tests.conftest import REPO

PRIVATE = re.compile(r"\btorch\.(?:[a-zA-Z]\w*\.)*_[a-zA-Z]|distributed_c10d\._|\._local_tensor\b")


def test_no_other_module_names_a_private_torch_api() -> None:
    own = Path(torch_private.__file__)
    offenders = [f"{path.relative_to(REPO)}:{i}" for path in sorted((REPO / "src" / "keel").rglob("*.py"))
                 if path != own for i, line in enumerate(path.read_text().splitlines(), 1)
                 if PRIVATE.search(line.split("#")[0]) and "# torch-private: " not in line]
    assert not offenders, offenders


def test_fused_norms_and_copies() -> None:
    tensors = [torch.randn(5), torch.randn(3, 4)]
    assert [n.item() for n in norms(tensors)] == [t.norm().item() for t in tensors] and norms([]) == []
    targets = [torch.zeros(5), torch.zeros(3, 4)]
    copy_all_(targets, tensors)
    assert all(torch.equal(a, b) for a, b in zip(targets, tensors, strict=True))


def test_in_backward_tells_a_recomputation_from_a_forward() -> None:
    seen: list[bool] = []
    inner = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    block = checkpoint_wrapper(inner)  # activation checkpointing recomputes the forward in the backward
    inner[0].register_forward_hook(lambda module, args, out: seen.append(in_backward()))
    block(torch.randn(2, 4, requires_grad=True)).sum().backward()
    assert seen == [False, True] and not in_backward()


def test_process_group_store_timeout_and_dtensor_local() -> None:
    init_distributed(torch.device("cpu"))
    try:
        _check_group_apis()
    finally:
        destroy_distributed()


def _check_group_apis() -> None:
    assert default_store() is not None and process_groups()
    for group in process_groups():
        set_group_timeout(60.0, group)
    mesh = dist.device_mesh.init_device_mesh("cpu", (1,))
    dtensor = DTensor.from_local(torch.zeros(3), mesh, [Replicate()])
    set_local_tensor(dtensor, torch.ones(3))
    assert torch.equal(dtensor.to_local(), torch.ones(3))


def test_fsspec_reader_and_writer_import() -> None:
    reader, writer = fsspec_checkpoint_io()
    assert reader.__name__ == "FsspecReader" and writer.__name__ == "FsspecWriter"
