"""The step's kernels (keel.plan.kernels): GEMMs timed by their shape (tiles, waves, the loop over K, the memory
floor), grouped GEMMs, attention by its kernel, the element-wise kernels by what the trainer fuses, and without
any kernel figures the FLOPs at the peak."""

from __future__ import annotations

from dataclasses import replace

import pytest

from keel.config import head_size, load_config
from keel.core.accelerators import by_key
from keel.plan.kernels import (
    CAUSAL_SHARE,
    DEFAULT_KERNELS,
    KERNELS,
    LOSS_BYTES,
    gemm_seconds,
    kernel_seconds,
    kernels_for,
    optimizer_seconds,
)
from keel.plan.layout import SOFTWARE, Layout, Workload
from tests.conftest import REPO

H100 = by_key("h100")
HOPPER = KERNELS["hopper"]
PEAK, BW = H100.peak_flops["bf16"], H100.memory_bw


def share(m: float, n: float, k: float, groups: int = 1) -> float:
    """The share of the bf16 peak a GEMM reaches on H100."""
    return 2 * m * n * k * groups / gemm_seconds(m, n, k, PEAK, BW, HOPPER, HOPPER.gemm, groups=groups) / PEAK


def test_a_large_gemm_runs_near_the_best_a_shape_search_reaches() -> None:
    large = share(16384, 16384, 16384)
    # Each tile's start and finish (16384 / (16384 + 256)) and the last of 63 waves of 8,192 tiles over 132 SMs.
    assert large == pytest.approx(HOPPER.gemm * 16384 / (16384 + 256) * 8192 / (63 * 132))
    assert 0.75 < large < HOPPER.gemm


def test_narrow_thin_and_ragged_gemms_lose_their_share() -> None:
    wide = share(8192, 8192, 8192)
    assert share(8192, 8192, 1024) < wide  # a short loop over K: start and finish weigh more
    # 132 tiles of 128 × 256 fill one wave of H100's 132 SMs; one more tile needs a second wave, nearly idle.
    full, ragged = share(128 * 12, 256 * 11, 4096), share(128 * 12 + 1, 256 * 11, 4096)
    assert ragged < 0.6 * full
    # A matrix-vector product is bound by memory: its operands moved at 80% of the bandwidth.
    seconds = gemm_seconds(1, 8192, 8192, PEAK, BW, HOPPER, HOPPER.gemm)
    assert seconds == pytest.approx((8192 + 8192 * 8192 + 8192) * 2 / (BW * HOPPER.memory))


def test_a_grouped_gemm_spreads_every_experts_tiles_over_the_sms() -> None:
    # 16 experts of 256 rows: one kernel fills the SMs that 16 separate small GEMMs leave idle.
    grouped = gemm_seconds(256, 1536, 2048, PEAK, BW, HOPPER, HOPPER.gemm, groups=16)
    apart = 16 * gemm_seconds(256, 1536, 2048, PEAK, BW, HOPPER, HOPPER.gemm)
    assert grouped < 0.5 * apart


def work_of(name: str, *overrides: str) -> Workload:
    return Workload.of(load_config(REPO / "configs" / f"{name}.toml", list(overrides)))


def step(work: Workload, layout: Layout, software: str, hw=H100) -> float:
    return kernel_seconds(replace(work, software=software), layout, hw, kernels_for(hw), SOFTWARE[software], 0.0)


def test_fusing_the_element_wise_kernels_halves_their_traffic_and_nothing_else() -> None:
    work, layout = work_of("llama3_8b"), Layout(dp_shard=8, micro_batch=1)
    eager, compiled = step(work, layout, "eager"), step(work, layout, "compiled")
    without_memory = replace(H100, memory_bw=0.0)  # the GEMMs and attention alone
    compute = step(work, layout, "eager", without_memory)
    assert compute == step(work, layout, "compiled", without_memory)
    # Eager moves twice what the fused kernels move (the difference is the fused traffic once); the loss's and the
    # optimizer's traffic stay as they are.
    fused = eager - compiled
    logits = work.seq_len * layout.micro_batch * work.model.vocab_size
    unchanged = (work.micro_batches(layout) * logits * LOSS_BYTES / (BW * HOPPER.memory)
                 + optimizer_seconds(work, layout, H100, HOPPER))
    assert compiled - compute == pytest.approx(fused + unchanged, rel=1e-9)
    assert 0.05 * compute < fused < 0.5 * compute


def test_materialised_attention_computes_every_score_and_a_flash_kernel_the_causal_half() -> None:
    work = work_of("llama3_8b", "train.seq_len=16384", "model.max_seq_len=32768")
    layout = Layout(dp_shard=8, micro_batch=1)
    a100 = by_key("a100")
    flash, materialised = step(work, layout, "transformer-engine", a100), step(work, layout, "unfused-attention", a100)
    assert materialised > flash
    # Doubling the sequence at the same tokens a step doubles each token's attention: the scores written out by
    # whole squares grow more than the flash kernel's causal half.
    longer = replace(work, seq_len=32768, global_batch=work.global_batch // 2)
    grown_flash = step(longer, layout, "transformer-engine", a100) - flash
    grown_materialised = step(longer, layout, "unfused-attention", a100) - materialised
    assert grown_materialised > grown_flash > 0


def test_selective_recomputation_runs_the_scores_forward_again_unless_the_block_is_recomputed() -> None:
    """Korthikanti et al. 2022 §5: the attention's scores are recomputed in the backward pass instead of kept: their
    two batched GEMMs and the softmax run forward once more; a fully recomputed block runs them again anyway."""
    work, layout, a100 = work_of("llama3_8b"), Layout(tp=8, micro_batch=1), by_key("a100")
    kept, recomputed = step(work, layout, "unfused-attention", a100), step(work, layout, "selective-recompute", a100)
    m, seq = work.model, work.seq_len
    heads, hd = m.n_heads / 8, head_size(m)
    peak, kern = a100.peak_flops["bf16"], KERNELS["ampere"]
    forward = sum(gemm_seconds(seq, n, k, peak, a100.memory_bw, kern, kern.gemm, groups=heads)
                  for n, k in ((seq, hd), (hd, seq)))
    softmax = 4 * seq * seq * heads / (a100.memory_bw * kern.memory)  # SOFTMAX_BYTES a score, read and written
    per_micro_batch = m.n_layers * (forward + softmax)
    assert recomputed - kept == pytest.approx(work.micro_batches(layout) * per_micro_batch, rel=1e-6)

    def full(software: str) -> float:
        return kernel_seconds(replace(work, software=software), replace(layout, ac="full"), a100, kernels_for(a100),
                              SOFTWARE[software], 1.0)

    assert full("selective-recompute") == pytest.approx(full("unfused-attention"))

def test_without_kernel_figures_the_kernels_add_up_to_the_flops_at_the_peak() -> None:
    """A CPU: no kernel figures (every kernel at its peak, no tiles) and no memory bandwidth. The step is then the
    FLOPs per token at the peak, the attention's causal half, as the planner timed it before it had kernels, less
    the 6 FLOPs a token that MFU's 6N counts for each norm's gain, which no GEMM computes."""
    cpu = replace(by_key("cpu"), peak_flops={"bf16": 1e12, "fp32": 1e12})
    assert kernels_for(cpu) == DEFAULT_KERNELS and cpu.memory_bw == 0
    work, layout = work_of("tiny"), Layout(dp_shard=2, micro_batch=4)
    attention = 12 * work.model.n_layers * work.model.n_heads * (work.model.dim // work.model.n_heads) * work.seq_len
    tokens = work.global_batch * work.seq_len / layout.gpus()
    gains = work.model.dim * (2 * work.model.n_layers + 1)
    expected = tokens * (work.flops_per_token - (1 - CAUSAL_SHARE) * attention - 6 * gains) / 1e12
    assert step(work, layout, "eager", cpu) == pytest.approx(expected, rel=1e-9)


def test_every_software_and_generation_has_its_figures() -> None:
    for soft in SOFTWARE.values():
        for kern in (*KERNELS.values(), DEFAULT_KERNELS):
            forward, backward = kern.attention_efficiency(soft.attention) if soft.attention != "materialised" \
                else (kern.gemm, kern.gemm)
            assert 0 < forward <= 1 and 0 < backward <= 1
    for kern in KERNELS.values():
        assert 0.5 < kern.gemm < 1 and kern.units > 0 and kern.source
