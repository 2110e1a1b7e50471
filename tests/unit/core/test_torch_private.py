"""Each private torch API keel calls still exists in the installed torch and does what keel relies on; no other
module of keel names a private torch API."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from keel.core import torch_private
from keel.core.torch_elastic import respawn_worker, worker_processes
from keel.core.torch_private import (
    checkpoint_wrapper,
    copy_all_,
    default_store,
    flash_attention_cpu,
    flash_attention_cpu_backward,
    flatten_mesh,
    float8_matmul,
    fsspec_checkpoint_io,
    in_backward,
    norms,
    pin_by_registering,
    process_groups,
    sdp_choice,
    set_group_timeout,
    set_local_tensor,
    shard_box,
    unflatten_mesh,
)
from keel.parallel.mesh import destroy_distributed, init_distributed
from tests.conftest import REPO

PRIVATE = re.compile(r"\btorch\.(?:[a-zA-Z]\w*\.)*_[a-zA-Z]|distributed_c10d\._|\._local_tensor\b")


def test_no_other_module_names_a_private_torch_api() -> None:
    own = {Path(torch_private.__file__), Path(torch_private.__file__).with_name("torch_elastic.py")}
    offenders = [f"{path.relative_to(REPO)}:{i}" for path in sorted((REPO / "src" / "keel").rglob("*.py"))
                 if path not in own for i, line in enumerate(path.read_text().splitlines(), 1)
                 if PRIVATE.search(line.split("#")[0]) and "# torch-private: " not in line]
    assert not offenders, offenders


def test_fused_norms_and_copies() -> None:
    tensors = [torch.randn(5), torch.randn(3, 4)]
    assert [n.item() for n in norms(tensors)] == [t.norm().item() for t in tensors] and norms([]) == []
    targets = [torch.zeros(5), torch.zeros(3, 4)]
    copy_all_(targets, tensors)
    assert all(torch.equal(a, b) for a, b in zip(targets, tensors, strict=True))


def test_a_float8_matmul_multiplies_the_scaled_operands() -> None:
    a, b = (torch.randn(32, 48).to(torch.float8_e4m3fn), torch.randn(16, 48).to(torch.float8_e4m3fn).t())
    scale_a, scale_b = torch.tensor(0.5), torch.tensor(2.0)
    product = float8_matmul(a, b, scale_a, scale_b, torch.float32)
    assert product.dtype == torch.float32 and product.shape == (32, 16)
    torch.testing.assert_close(product, (a.float() * 0.5) @ (b.float() * 2.0), rtol=1e-5, atol=1e-5)


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
    rows = DTensor.from_local(torch.zeros(2, 3), mesh, [Shard(0)])  # the one rank holds every row
    assert shard_box(rows) == ([0, 0], [2, 3])
    two = dist.device_mesh.init_device_mesh("cpu", (1, 1), mesh_dim_names=("a", "b"))
    flat = flatten_mesh(two["a", "b"], "a_b")
    assert flat.mesh_dim_names == ("a_b",) and flat.size() == 1
    split = unflatten_mesh(flat, (1, 1), ("c", "d"))
    assert split.mesh_dim_names == ("c", "d") and split["d"].size() == 1


def test_fsspec_reader_and_writer_import() -> None:
    reader, writer = fsspec_checkpoint_io()
    assert reader.__name__ == "FsspecReader" and writer.__name__ == "FsspecWriter"


def test_pinned_memory_is_registered_by_threads_and_a_users_own_settings_are_kept(monkeypatch) -> None:
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "pinned_num_register_threads:2")
    before = torch._C._accelerator_getAllocatorSettings()
    pin_by_registering(threads=4)  # the user chose a pinned option: theirs win, nothing is set
    assert torch._C._accelerator_getAllocatorSettings() == before
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "garbage_collection_threshold:0.9")
    pin_by_registering(threads=4)
    assert torch._C._accelerator_getAllocatorSettings() == (
        "garbage_collection_threshold:0.9,pinned_use_cuda_host_register:True,pinned_num_register_threads:4")


def test_cpu_flash_attention_returns_the_log_sum_exp_and_its_backward_the_gradients() -> None:
    q, k, v = torch.randn(1, 2, 6, 8), torch.randn(1, 1, 6, 8), torch.randn(1, 1, 6, 8)
    out, lse = flash_attention_cpu(q, k, v, True, None, None)
    scores = (q @ k.transpose(-1, -2) / 8**0.5).masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), float("-inf"))
    assert torch.allclose(lse, scores.logsumexp(-1), atol=1e-6)
    grad = torch.randn_like(out)
    dq, dk, dv = flash_attention_cpu_backward(grad, q, k, v, out, lse, True, None, None)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True).backward(grad)
    assert all(torch.allclose(a, b.grad, atol=1e-6) for a, b in zip((dq, dk, dv), leaves, strict=True))


def test_sdp_choice_names_the_kernel_torch_runs_under_the_kernels_enabled() -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k = torch.randn(2, 4, 16, 8), torch.randn(2, 2, 16, 8)
    assert sdp_choice(q, k, k, None, causal=True, gqa=True) == SDPBackend.FLASH_ATTENTION.value  # the CPU's flash
    with sdpa_kernel([SDPBackend.MATH]):
        assert sdp_choice(q, k, k, None, causal=True, gqa=True) == SDPBackend.MATH.value


def _worker(go: str) -> str:
    """Local rank 1 dies by SIGKILL unless it is the process started again; then each waits for `go`."""
    if os.environ["LOCAL_RANK"] == "1" and "AGAIN" not in os.environ:
        os.kill(os.getpid(), signal.SIGKILL)
    while not os.path.exists(go):
        time.sleep(0.01)
    return os.environ.get("AGAIN", "first")


def test_a_killed_worker_of_torchruns_context_is_started_again_alone_in_its_place(tmp_path: Path) -> None:
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes

    go = tmp_path / "go"
    context = start_processes("respawn", _worker, args={0: (str(go),), 1: (str(go),)},
                              envs={0: {"LOCAL_RANK": "0"}, 1: {"LOCAL_RANK": "1"}},
                              logs_specs=DefaultLogsSpecs(log_dir=str(tmp_path / "logs")), start_method="fork")
    try:
        first, killed = worker_processes(context)
        killed.join(30)
        assert killed.exitcode == -signal.SIGKILL
        pid = respawn_worker(context, 1, {"AGAIN": "again"})
        go.touch()
        result = context.wait(60)
        assert result is not None and not result.is_failed(), result
        assert result.return_values == {0: "first", 1: "again"}
        assert pid != killed.pid and [p.pid for p in worker_processes(context)] == [first.pid, pid]
    finally:
        context.close()
