"""Which SDPA kernel the attention runs (model.sdpa_backend): the one asked for, or the one torch picks (auto), and
whether the device can run it for the run's shapes and dtype, told at start rather than at the first step."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from keel.core.torch_private import sdp_choice
from keel.errors import ConfigError

BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}
NAMES = {backend: name for name, backend in BACKENDS.items()}


def sdpa_context(backend: str) -> AbstractContextManager:
    """What the attention's SDPA call runs under: only `backend`'s kernel, or torch's own choice (auto)."""
    return nullcontext() if backend == "auto" else sdpa_kernel([BACKENDS[backend]])


def probe(batch: int, heads: int, kv_heads: int, seq: int, head_dim: int, dtype: torch.dtype, device: torch.device,
          masked: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Query, key, value (and the document mask when there is one) of the run's attention shapes."""
    q = torch.zeros(batch, heads, seq, head_dim, dtype=dtype, device=device)
    k = torch.zeros(batch, kv_heads, seq, head_dim, dtype=dtype, device=device)
    mask = torch.ones(batch, 1, seq, seq, dtype=torch.bool, device=device).tril() if masked else None
    return q, k, k, mask


def runnable(backend: SDPBackend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             mask: torch.Tensor | None) -> bool:
    """Whether SDPA can run `backend`'s kernel on these inputs (causal unless masked, heads grouped as given)."""
    if backend == SDPBackend.MATH:
        return True
    gqa = q.shape[1] != k.shape[1]
    if q.device.type == "cuda":
        params = torch.backends.cuda.SDPAParams(q, k, v, mask, 0.0, mask is None, gqa)
        check = {SDPBackend.FLASH_ATTENTION: torch.backends.cuda.can_use_flash_attention,
                 SDPBackend.EFFICIENT_ATTENTION: torch.backends.cuda.can_use_efficient_attention,
                 SDPBackend.CUDNN_ATTENTION: torch.backends.cuda.can_use_cudnn_attention}[backend]
        return bool(check(params))
    # Elsewhere torch has one fused kernel (the CPU's flash attention) besides math: it runs when torch picks it.
    return sdp_choice(q, k, v, mask, causal=mask is None, gqa=gqa) == backend.value


def resolve_backend(asked: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> str:
    """The kernel the attention will run on these inputs: `asked`, or torch's pick for auto. A kernel the device
    cannot run for them is a one-line ConfigError naming those it can."""
    if asked == "auto":
        return NAMES[SDPBackend(sdp_choice(q, k, v, mask, causal=mask is None, gqa=q.shape[1] != k.shape[1]))]
    if runnable(BACKENDS[asked], q, k, v, mask):
        return asked
    can = [name for name, backend in BACKENDS.items() if runnable(backend, q, k, v, mask)]
    inputs = f"{q.dtype} heads of {q.shape[-1]} on {q.device.type}" + (" with a document mask" if mask is not None
                                                                       else "")
    raise ConfigError(f"model.sdpa_backend = {asked!r} cannot run the attention here ({inputs}); this device runs "
                      f"{', '.join(['auto', *can])}")
