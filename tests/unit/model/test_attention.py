"""model.sdpa_backend: the attention runs the SDPA kernel asked for, auto names torch's pick, and a kernel the
device cannot run is a one-line error."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from keel.config import ModelConfig
from keel.errors import ConfigError
from keel.model.attention import probe, resolve_backend
from keel.model.init import init_weights
from keel.model.llama import Llama

TINY = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=61, multiple_of=16, max_seq_len=16)
CPU_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default


class Ops(TorchDispatchMode):
    """The operations run under it."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[Any] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.seen.add(func)
        return func(*args, **(kwargs or {}))


def run(backend: str, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, set[Any]]:
    torch.manual_seed(0)
    model = Llama(dataclasses.replace(TINY, sdpa_backend=backend))
    init_weights(model, 0)
    x = torch.randint(0, TINY.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with Ops() as ops, torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        logits = model(x)
    return logits.float(), ops.seen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("masked", [False, True])
def test_auto_names_the_cpu_flash_kernel_torch_picks(dtype: torch.dtype, masked: bool) -> None:
    assert resolve_backend("auto", *probe(2, 4, 2, 16, 8, dtype, torch.device("cpu"), masked)) == "flash"


@pytest.mark.parametrize("backend", ["flash", "math"])
def test_a_kernel_the_cpu_runs_is_taken_as_asked(backend: str) -> None:
    assert resolve_backend(backend, *probe(2, 4, 2, 16, 8, torch.bfloat16, torch.device("cpu"), False)) == backend


@pytest.mark.parametrize("backend", ["efficient", "cudnn"])
def test_a_kernel_the_cpu_lacks_is_refused_in_one_line_naming_those_it_runs(backend: str) -> None:
    with pytest.raises(ConfigError) as e:
        resolve_backend(backend, *probe(2, 4, 2, 16, 8, torch.float32, torch.device("cpu"), True))
    message = str(e.value)
    assert "\n" not in message and f"'{backend}'" in message and message.endswith("runs auto, flash, math")


def test_the_attention_runs_the_kernel_asked_for_and_both_kernels_agree() -> None:
    flash, flash_ops = run("flash")
    math, math_ops = run("math")
    auto, auto_ops = run("auto")
    assert CPU_FLASH in flash_ops and CPU_FLASH in auto_ops and CPU_FLASH not in math_ops
    assert torch.equal(auto, flash)
    torch.testing.assert_close(math, flash, rtol=1e-4, atol=1e-5)
