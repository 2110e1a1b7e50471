"""The fused cross entropy: the same loss and gradients as torch's, slice by slice, with and without a
z-loss, on bf16 and fp32 logits; what it keeps for its backward is the logits and a log Z per token."""

from __future__ import annotations

import pytest
import torch

import keel.model.loss as loss_module
from keel.config import load_config
from keel.errors import ConfigError
from keel.model.loss import Objective


def losses_and_gradients(kind: str, z_loss: float, dtype: torch.dtype) -> tuple[float, float, torch.Tensor]:
    torch.manual_seed(0)
    weight = torch.randn(16, 50, requires_grad=True)
    hidden, targets = torch.randn(3, 9, 16) * 2, torch.randint(0, 50, (3, 9))
    differentiated, cross_entropy = Objective(z_loss, kind)((hidden @ weight).to(dtype), targets)
    differentiated.backward()
    assert weight.grad is not None
    return differentiated.item(), cross_entropy.item(), weight.grad


@pytest.mark.parametrize("z_loss", [0.0, 1e-2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_cross_entropy_matches_torch_in_loss_and_gradient(z_loss: float, dtype: torch.dtype,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loss_module, "FUSED_CHUNK", 7 * 50)  # 27 rows in slices of 7: the last one shorter
    want, got = losses_and_gradients("torch", z_loss, dtype), losses_and_gradients("fused", z_loss, dtype)
    assert got[0] == pytest.approx(want[0], rel=1e-6) and got[1] == pytest.approx(want[1], rel=1e-6)
    assert got[0] != got[1] if z_loss else got[0] == got[1]
    # bf16 logits: both round the logits' gradient to bf16 before the projection's backward.
    torch.testing.assert_close(got[2], want[2], rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-6)


def test_fused_cross_entropy_keeps_only_the_logits_and_a_log_normaliser_per_token() -> None:
    logits = torch.randn(4, 8, 1000, requires_grad=True)
    targets = torch.randint(0, 1000, (4, 8))
    kept: dict[str, int] = {}
    for kind in ("torch", "fused"):
        saved: dict[int, torch.Tensor] = {}

        def pack(t: torch.Tensor, into: dict[int, torch.Tensor] = saved) -> torch.Tensor:
            into[id(t)] = t
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            Objective(cross_entropy=kind)(logits * 1.0, targets)
        kept[kind] = sum(t.numel() * t.element_size() for t in saved.values() if t.dtype.is_floating_point)
    logit_bytes = logits.numel() * 4
    assert kept["fused"] == logit_bytes + 32 * 4, "the fp32 logits and 32 log Z"
    assert kept["torch"] >= logit_bytes, "torch keeps the log-probabilities, as large as the logits"


def test_the_fused_gradient_is_written_over_the_logits() -> None:
    logits, targets = torch.randn(2, 5, 40, requires_grad=True), torch.randint(0, 40, (2, 5))
    Objective()(logits, targets)[0].backward()
    out = logits.detach().clone().requires_grad_() * 1.0
    Objective(cross_entropy="fused")(out, targets)[0].backward()
    torch.testing.assert_close(out.detach(), logits.grad), "no second buffer the size of the logits"


def test_an_unknown_cross_entropy_is_refused() -> None:
    with pytest.raises(ConfigError) as e:
        load_config(None, ["train.cross_entropy=liger"])
    assert "train.cross_entropy" in str(e.value) and "fused" in str(e.value)
