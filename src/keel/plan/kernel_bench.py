"""One process of `keel plan --calibrate-sweep`: the kernels the planner times, run on this process's device, and
the collectives the layouts use, over every process of the sweep (torchrun starts them; keel.plan.sweep reads
what they write).

Every process times the same work at the same time, as a job's ranks run theirs: the GEMMs of the planned
model's linear layers and a few large square ones (in the dtype the model computes in; on a GPU with float8
matmuls, the same in float8 with tensor-wide scales), the attention kernel torch picks for the model's heads and
sequence (causal; forward, then forward and backward), an element-wise add over a buffer far larger than any
cache (memory bandwidth), and all-gather, reduce-scatter, all-reduce and all-to-all at sizes from a few MiB up.
Each process writes OUT/rank-R.json.

    python -m torch.distributed.run --standalone --nproc-per-node N -m keel.plan.kernel_bench SPEC.json OUT
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from keel.core.torch_private import float8_matmul

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device, min_s: float) -> float:
    """Seconds per call of `fn`: warmed up, then run in batches that double until one lasts `min_s`."""
    fn()
    _sync(device)
    calls = 1
    while True:
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        _sync(device)
        elapsed = time.perf_counter() - start
        if elapsed >= min_s:
            return elapsed / calls
        calls *= 2


def gemms(spec: dict, device: torch.device) -> list[dict]:
    """Each GEMM of M×K by K×N of the spec, in the model's dtype."""
    dtype = DTYPES[spec["dtype"]]
    out = []
    for m, n, k, label in spec["gemms"]:
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        out.append({"m": m, "n": n, "k": k, "label": label, "s": timed(partial(torch.mm, a, b), device, spec["min_s"])})
    return out


def float8_gemms(spec: dict, device: torch.device) -> list[dict]:
    """The same GEMMs in float8 (e4m3, one scale per tensor, a bf16 result): where the device has float8
    matmuls (`float8_matmul`), and for the shapes its kernel takes (every side a multiple of 16). The second
    operand is laid out column-major, as the kernel requires."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
        return []
    one = torch.ones((), device=device)
    out = []
    for m, n, k, label in spec["gemms"]:
        if m % 16 or n % 16 or k % 16:
            continue
        a = torch.randn(m, k, device=device).to(torch.float8_e4m3fn)
        b = torch.randn(n, k, device=device).to(torch.float8_e4m3fn).t()
        call = partial(float8_matmul, a, b, one, one, torch.bfloat16)
        out.append({"m": m, "n": n, "k": k, "label": label, "s": timed(call, device, spec["min_s"])})
    return out


def attention(spec: dict, device: torch.device) -> dict:
    """The model's causal attention over one micro-batch: the forward alone, and forward with backward."""
    shape = spec["attention"]
    dtype = DTYPES[spec["dtype"]]
    batch, seq, hd = shape["batch"], shape["seq"], shape["head_dim"]
    q = torch.randn(batch, shape["heads"], seq, hd, device=device, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(batch, shape["kv_heads"], seq, hd, device=device, dtype=dtype, requires_grad=True)
            for _ in range(2))
    grouped = shape["heads"] != shape["kv_heads"]

    def forward() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=grouped)

    grad = torch.randn(batch, shape["heads"], seq, hd, device=device, dtype=dtype)

    def trained() -> None:
        torch.autograd.grad(forward(), (q, k, v), grad)

    with torch.no_grad():
        forward_s = timed(forward, device, spec["min_s"])
    both = timed(trained, device, spec["min_s"])
    return {**shape, "forward_s": forward_s, "backward_s": max(both - forward_s, 0.0)}


def memory(spec: dict, device: torch.device) -> dict:
    """An element-wise add over buffers far past the caches: two reads and a write an element."""
    dtype = DTYPES[spec["dtype"]]
    a, b = (torch.randn(spec["memory_elements"], device=device, dtype=dtype) for _ in range(2))
    c = torch.empty_like(a)
    seconds = timed(lambda: torch.add(a, b, out=c), device, spec["min_s"])
    return {"bytes": 3 * a.numel() * a.element_size(), "s": seconds}


def _collective_calls(whole: torch.Tensor, part: torch.Tensor) -> dict[str, Callable[[], object]]:
    """Each collective over `whole` (the gathered buffer) and `part` (a rank's share of it)."""
    received = torch.empty_like(whole)
    return {"all_gather": partial(dist.all_gather_into_tensor, whole, part),
            "reduce_scatter": partial(dist.reduce_scatter_tensor, part, whole),
            "all_reduce": partial(dist.all_reduce, whole),
            "all_to_all": partial(dist.all_to_all_single, received, whole)}


def collectives(spec: dict, device: torch.device) -> list[dict]:
    """Each collective at each size (bytes of the whole buffer, as the planner counts them: the gathered one of an
    all-gather or reduce-scatter, the one a rank sends in an all-to-all), the same number of calls on every rank."""
    n, out = dist.get_world_size(), []
    for size in spec["collective_bytes"]:
        whole = torch.ones(size // 4 // n * n, device=device)
        for kind, call in _collective_calls(whole, torch.ones(whole.numel() // n, device=device)).items():
            call()
            dist.barrier()
            _sync(device)
            start = time.perf_counter()
            for _ in range(spec["collective_calls"]):
                call()
            _sync(device)
            out.append({"kind": kind, "bytes": whole.numel() * 4,
                        "s": (time.perf_counter() - start) / spec["collective_calls"]})
    return out


def main(argv: list[str]) -> int:
    spec, out = json.loads(Path(argv[0]).read_text()), Path(argv[1])
    cuda = spec["device"] == "cuda"
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    try:
        torch.manual_seed(dist.get_rank())
        result = {"rank": dist.get_rank(), "world": dist.get_world_size(),
                  "device": torch.cuda.get_device_name(device) if cuda else "cpu",
                  "gemm": gemms(spec, device), "gemm_fp8": float8_gemms(spec, device),
                  "attention": attention(spec, device), "memory": memory(spec, device),
                  "collectives": collectives(spec, device) if dist.get_world_size() > 1 else []}
        (out / f"rank-{dist.get_rank()}.json").write_text(json.dumps(result))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
