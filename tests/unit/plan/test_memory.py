"""The memory model: ZeRO's model-state accounting exactly, a block's activations as autograd keeps them,
published layouts (torchtitan's measured peaks) on the hardware they ran on, and properties that hold
for any layout (hypothesis)."""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import replace
from functools import cache
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from keel.config import ModelConfig, load_config
from keel.core.accelerators import Accelerator, by_key
from keel.model.llama import Block, rope_tables
from keel.plan.layout import Layout, Workload
from keel.plan.memory import GIB, NCCL_BUFFERS, block_activations, first_fix, memory, suggest
from keel.plan.report import Question, answer, lines
from tests.conftest import REPO

H100, A100 = by_key("h100"), by_key("a100")
CALIBRATION_RUN = Path(__file__).parent / "calibration_run"  # a real 2-process CPU run (test_throughput.py)
# torchtitan's Dec 2024 benchmarks ran on Grand Teton H100s with 96 GB HBM2e, "95 GiB" in torchtitan's
# asyncTP benchmark (benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md); not a catalogued product.
H100_96 = replace(H100, key="h100-96", name="H100 96GB HBM2e", memory_bytes=95 * GIB)
# torchtitan docs/performance.md ran the 405B model on "128 H100 (94GB memory)".
H100_94 = replace(H100, key="h100-94", name="H100 94GB", memory_bytes=94 * GIB)


@cache
def model(name: str) -> ModelConfig:
    return load_config(f"configs/{name}.toml", []).model


def state(work: Workload, layout: Layout, hw: Accelerator = H100) -> float:
    mem = memory(work, layout, hw)
    return mem.params + mem.grads + mem.optimizer


# ZeRO (arXiv 1910.02054 §3.1): mixed-precision Adam holds 2 + 2 + 12 = 16 bytes per parameter; ZeRO-3 / FSDP
# over N ranks holds 16/N.

def test_model_state_is_16_bytes_per_parameter_unsharded() -> None:
    work = Workload(model("llama3_8b"), 8192, 8)
    mem = memory(work, Layout(), H100)
    assert (mem.params, mem.grads, mem.optimizer) == (2 * work.n_params, 2 * work.n_params, 12 * work.n_params)
    assert state(work, Layout()) == 16 * work.n_params


@pytest.mark.parametrize("n", [2, 8, 64, 512])
def test_fsdp_shards_the_whole_state(n: int) -> None:
    work = Workload(model("llama3_70b"), 8192, 1024)
    assert state(work, Layout(dp_shard=n)) == pytest.approx(16 * work.n_params / n, rel=1e-12)
    # HSDP replicas each hold a full set of shards: the per-device state does not change.
    assert state(work, Layout(dp_shard=n, dp_replicate=4)) == state(work, Layout(dp_shard=n))
    # TP divides every matrix.
    assert state(work, Layout(tp=8, dp_shard=n)) == pytest.approx(16 * work.n_params / (8 * n), rel=1e-12)


def first_of_four_stages(work: Workload) -> int:
    """Parameters of Llama 3 70B's first pipeline stage of 4: 20 of its 80 blocks and the embedding (the last
    stage's output projection is as large)."""
    cfg = work.model
    per_block = (work.n_params - 2 * cfg.vocab_size * cfg.dim - cfg.dim) // cfg.n_layers
    return 20 * per_block + cfg.vocab_size * cfg.dim


def test_pipeline_ranks_hold_their_stage() -> None:
    work = Workload(model("llama3_70b"), 8192, 64)
    assert state(work, Layout(pp=4)) == 16 * first_of_four_stages(work)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_block_activations_are_what_autograd_keeps(dtype: str) -> None:
    """Sum the tensors one keel block saves for its backward pass (weights and the RoPE table aside), in bf16
    and in fp32 (keel's CPU precision). On CPU rms_norm is a composite whose autograd also keeps the
    normalised fp32 tensor, which CUDA's fused kernel does not (`composite_norm`)."""
    cfg = ModelConfig(dim=256, n_heads=8, n_kv_heads=2, ffn_dim_multiplier=1.3, multiple_of=64)
    block = Block(cfg).to(torch.bfloat16 if dtype == "bf16" else torch.float32)
    seq, batch = 128, 2
    x = torch.randn(batch, seq, cfg.dim, dtype=next(block.parameters()).dtype, requires_grad=True)
    rope = rope_tables(cfg.dim // cfg.n_heads, seq, cfg.rope_theta)
    constant = {t.untyped_storage().data_ptr() for t in (*block.parameters(), rope)}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in constant:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        block(x, rope)
    work = Workload(cfg, seq, 1, param_dtype=dtype)
    kept, checkpointed = block_activations(work, batch, tp=1, sp=False, composite_norm=True)
    assert sum(saved.values()) == pytest.approx(kept, rel=0.01)
    assert checkpointed == x.element_size() * seq * batch * cfg.dim


def test_tensor_and_sequence_parallel_split_activations() -> None:
    work = Workload(model("llama3_70b"), 8192, 64)
    whole, _ = block_activations(work, 1, tp=1, sp=False)
    tp8, ckpt8 = block_activations(work, 1, tp=8, sp=False)
    sp8, ckpt_sp8 = block_activations(work, 1, tp=8, sp=True)
    assert whole > tp8 > sp8 > whole / 8  # the gathered inputs of the column-parallel linears stay whole
    assert ckpt_sp8 == ckpt8 / 8


def test_megatron_keeps_the_sequence_parallel_shard_and_keel_the_gathered_input() -> None:
    """Korthikanti et al. 2022 §4.2.2: Megatron-Core all-gathers a norm output again in the backward pass, and with
    sequence parallelism its whole block is split by t (their 34·sbh/t with selective recompute, in a GPT block)."""
    e, h, seq, tp = 2, 8192, 8192, 8
    keel = Workload(model("llama3_70b"), seq, 64)
    megatron = replace(keel, software="transformer-engine")
    kept_by_keel, _ = block_activations(keel, 1, tp=tp, sp=True)
    kept_by_megatron, _ = block_activations(megatron, 1, tp=tp, sp=True)
    assert kept_by_keel - kept_by_megatron == pytest.approx(2 * e * seq * h * (1 - 1 / tp))
    assert block_activations(megatron, 1, tp=tp, sp=False) == block_activations(keel, 1, tp=tp, sp=False)
    whole, _ = block_activations(megatron, 1, tp=1, sp=False)
    assert kept_by_megatron == pytest.approx(whole / tp, rel=0.01)  # everything split, up to the log-sum-exp



def test_a_materialised_attention_keeps_its_softmax_output_unless_it_recomputes_the_scores() -> None:
    """Megatron-LM before flash attention kept the probabilities, a·s² elements a sequence and block (2 bytes each
    in 16-bit), split over tp with the heads; its selective recomputation (Korthikanti et al. 2022 §5) keeps none."""
    seq, tp = 2048, 8
    flash = Workload(model("llama3_70b"), seq, 64, software="transformer-engine")
    materialised, selective = (replace(flash, software=s) for s in ("unfused-attention", "selective-recompute"))
    kept = block_activations(flash, 4, tp=tp, sp=True)[0]
    assert block_activations(materialised, 4, tp=tp, sp=True)[0] - kept == pytest.approx(
        2 * model("llama3_70b").n_heads * seq * seq * 4 / tp)
    assert block_activations(selective, 4, tp=tp, sp=True) == block_activations(flash, 4, tp=tp, sp=True)
    # Checkpointed, a block keeps its input alone, whichever the attention.
    assert block_activations(materialised, 4, tp=tp, sp=True)[1] == block_activations(flash, 4, tp=tp, sp=True)[1]

# Published layouts. torchtitan's benchmarks/llama3_h100_202412_torchtitan.md (torch, torchao and torchtitan of
# 2024-12) report the peak memory per GPU (GiB, maximum over ranks) next to throughput; they ran on 96 GB H100s.
# The published figure is reserved memory: the model's allocated peak and the allocator's fragmentation.

def test_llama3_70b_fsdp32_tp8_full_ac_fits_an_80gb_h100() -> None:
    """Table 4: 256 GPUs, FSDP 32 × TP 8, local batch 16 at seq 8192, full AC (with compile and Float8): 71.9 GiB,
    under an 80 GiB H100's capacity too."""
    work = Workload(model("llama3_70b"), 8192, 512)
    mem = memory(work, Layout(tp=8, dp_shard=32, micro_batch=16, ac="full"), H100)
    assert mem.fits
    assert mem.reserved / GIB == pytest.approx(71.9, rel=0.15)


def test_a_pipeline_stage_under_fsdp_keeps_its_parameters_gathered_and_its_gradients_whole() -> None:
    # From the first micro-batch to the gradient sync (keel.parallel.apply): bf16 parameters, bf16 gradients and
    # their fp32 copy for the reduction, 8 bytes a parameter of the stage, beside a communicator per group.
    work = Workload(model("llama3_70b"), 8192, 64)
    assert memory(work, Layout(pp=4, dp_shard=8), H100).buffers == 2 * NCCL_BUFFERS + 8 * first_of_four_stages(work)


def test_gpipe_holds_every_micro_batch_and_the_1f1b_schedules_one_per_stage_ahead() -> None:
    work = Workload(model("llama3_8b"), 8192, 32)  # 32 micro-batches of 1 over 4 stages
    kept = {schedule: memory(work, Layout(pp=4, v=v, micro_batch=1, schedule=schedule), H100)
            for schedule, v in (("1f1b", 1), ("gpipe", 1), ("interleaved_1f1b", 2), ("interleaved_zb", 2))}
    one = kept["1f1b"].pipeline_inflight / 3  # the first stage's 4 in flight, one counted as its activations
    assert kept["gpipe"].pipeline_inflight == pytest.approx(31 * one)
    assert kept["interleaved_zb"].pipeline_inflight == kept["interleaved_1f1b"].pipeline_inflight


def test_llama3_405b_fsdp8_tp8_pp8_fits_the_h100_it_ran_on() -> None:
    """Table 5: 512 GPUs, FSDP 8 × TP 8 × PP 8, local batch 32 in 8 micro-batches (torchtitan's default: one per
    pipeline stage), full AC, 1F1B: 82.5 GiB, which fits the 95 GiB part but is over an 80 GiB one."""
    work = Workload(model("llama3_405b"), 8192, 256)
    mem = memory(work, Layout(tp=8, pp=8, dp_shard=8, micro_batch=4, ac="full"), H100_96)
    assert mem.fits and mem.pipeline_inflight > 0
    assert mem.reserved / GIB == pytest.approx(82.5, rel=0.15)


def test_llama3_8b_fsdp8_local_batch_2() -> None:
    """Table 1: 8 GPUs, FSDP 8, local batch 2 at seq 8192, selective AC (torchtitan's op-level policy, which
    keeps some matmul outputs of every block): 82.4 GiB, more than an 80 GiB H100 holds. keel's selective
    AC checkpoints every other whole block, keeping more than torchtitan's and less than full AC, so the
    measurement lies between the two predictions."""
    work = Workload(model("llama3_8b"), 8192, 16)
    layout = Layout(dp_shard=8, micro_batch=2, ac="selective")
    selective, full = memory(work, layout, H100_96), memory(work, replace(layout, ac="full"), H100_96)
    assert full.reserved < 82.4 * GIB < selective.reserved
    assert not memory(work, layout, H100).fits and full.fits
    # Its loss holds 12 bytes per logit at the backward; the fused cross entropy's 2 make it fit an 80 GB part.
    assert suggest(work, layout, H100).endswith("; try train.cross_entropy=fused or tp=2 dp_shard=4")
    assert memory(replace(work, cross_entropy="fused"), layout, H100).fits


def test_llama3_8b_fsdp64_local_batch_1_selective_fits_an_a100() -> None:
    """torchtitan docs/performance.md: Llama 3 8B on 64 A100 80GB, FSDP, local batch 1, selective layer AC."""
    work = Workload(model("llama3_8b"), 8192, 64)
    assert memory(work, Layout(dp_shard=64, ac="selective"), A100).fits


def test_layouts_known_not_to_fit() -> None:
    # 70B with FSDP alone on 8 GPUs: the model state by itself is 16 × 70.6e9 / 8 = 141 GB per GPU.
    work = Workload(model("llama3_70b"), 8192, 8)
    mem = memory(work, Layout(dp_shard=8, ac="full"), H100)
    assert not mem.fits and state(work, Layout(dp_shard=8)) > H100.memory_bytes
    # torchtitan docs/performance.md: 405B on 128 H100 94GB "We do see OOM for 1D parallelism (FSDP2)" (local
    # batch 2, full AC).
    work = Workload(model("llama3_405b"), 8192, 256)
    assert not memory(work, Layout(dp_shard=128, micro_batch=2, ac="full"), H100_94).fits


def test_explain_and_suggest_name_the_problem_and_the_fix() -> None:
    work = Workload(model("llama3_70b"), 8192, 64)
    layout = Layout(tp=4, dp_shard=16)
    mem = memory(work, layout, H100)
    assert not mem.fits and mem.headroom < 0
    assert re.fullmatch(r"\d+\.\d GiB per device at tp4 dp_shard16 mb1 \(activations [\d.]+, optimizer [\d.]+, "
                        r"backward [\d.]+; [\d.]+ reserved with fragmentation\); NVIDIA H100 SXM has 80 GiB, "
                        r"[\d.]+ usable: does not fit", mem.explain())
    assert re.fullmatch(r"needs \d+ GiB per device at tp=4 dp_shard=16; NVIDIA H100 SXM has 80 GiB \(\d+ usable\); "
                        r"try tp=8 dp_shard=8", suggest(work, layout, H100))
    fitting = replace(layout, ac="full")
    assert suggest(work, fitting, H100) == memory(work, fitting, H100).explain()


# Properties over layouts.

MODELS = st.sampled_from(["llama3_8b", "llama3_70b", "llama3_405b"])
LAYOUTS = st.builds(Layout, tp=st.sampled_from([1, 2, 4, 8]), pp=st.sampled_from([1, 2, 4, 8]),
                    v=st.sampled_from([1, 2]), dp_shard=st.sampled_from([1, 2, 4, 8, 16, 64]),
                    dp_replicate=st.sampled_from([1, 2]), micro_batch=st.integers(1, 8),
                    ac=st.sampled_from(["none", "selective", "full"]), sp=st.booleans())
SEQ = st.sampled_from([512, 1024, 2048, 4096, 8192])
BATCH = st.integers(1, 4096)


@settings(max_examples=200, deadline=None)
@given(MODELS, LAYOUTS, SEQ, BATCH, st.integers(1, 8))
def test_memory_never_falls_with_micro_batch(name: str, layout: Layout, seq: int, batch: int, more: int) -> None:
    work = Workload(model(name), seq, batch)
    bigger = replace(layout, micro_batch=layout.micro_batch + more)
    assert memory(work, bigger, H100).total >= memory(work, layout, H100).total


@settings(max_examples=200, deadline=None)
@given(MODELS, LAYOUTS, SEQ, BATCH, st.sampled_from([2, 3, 4]))
def test_memory_never_falls_with_sequence_length(name: str, layout: Layout, seq: int, batch: int, k: int) -> None:
    short, long = Workload(model(name), seq, batch), Workload(model(name), seq * k, batch)
    assert memory(long, layout, H100).total >= memory(short, layout, H100).total


@settings(max_examples=300, deadline=None)
@given(MODELS, LAYOUTS, st.sampled_from(["dp_shard", "tp", "pp"]), st.sampled_from([2, 3, 4]))
def test_sharding_never_raises_parameter_memory(name: str, layout: Layout, dim: str, factor: int) -> None:
    work = Workload(model(name), 4096, 1024)
    sharded = replace(layout, **{dim: getattr(layout, dim) * factor})
    if sharded.pp * sharded.v > work.model.n_layers:
        return
    before, after = memory(work, layout, H100), memory(work, sharded, H100)
    assert after.params <= before.params
    assert state(work, sharded) <= state(work, layout)


@settings(max_examples=100, deadline=None)
@given(MODELS, LAYOUTS, st.sampled_from([512, 2048, 8192]), BATCH, st.sampled_from(["h100", "a100-40", "mi300x"]))
def test_a_suggested_fix_really_fits(name: str, layout: Layout, seq: int, batch: int, key: str) -> None:
    work, hw = Workload(model(name), seq, batch), by_key(key)
    if layout.pp * layout.v > work.model.n_layers:
        return
    message, fix = suggest(work, layout, hw), first_fix(work, layout, hw)
    if memory(work, layout, hw).fits:
        assert "needs" not in message
        return
    assert message.startswith("needs ")
    fused = memory(replace(work, cross_entropy="fused"), layout, hw).fits
    assert ("; try train.cross_entropy=fused" in message) == fused
    if fix is None:
        assert message.endswith("; try train.cross_entropy=fused" if fused else "no layout change found that fits")
        return
    named = dict(re.findall(r"(\w+)=(\w+)", message.split("; try ")[1].split(" or ")[-1]))
    parsed = replace(layout, **{k: v if k == "ac" else int(v) for k, v in named.items()})
    assert parsed == fix and memory(work, fix, hw).fits
    assert fix.gpus() == layout.gpus() or f"({fix.gpus()} GPUs)" in message


def test_calibrating_on_a_run_sets_the_memory_model_beside_its_own_peak(tmp_path: Path) -> None:
    """`keel plan --calibrate RUN_DIR` compares the memory model with the run's measured peak above its
    runtime; a run from before keel measured it says why it is not checked. (Real runs against the model:
    tests/dist/test_memory_model.py.)"""
    cfg = load_config(REPO / "configs" / "llama3_8b.toml", [])
    old = answer(Question(cfg, 8, "h100", 1e11, calibrate_from=CALIBRATION_RUN, trials=50))
    assert "memory/above_runtime_bytes_max_rank" in old["memory_check"]["unavailable"]
    assert any(line.startswith("memory model: not checked (") for line in lines(old))
    run = tmp_path / "run"
    shutil.copytree(CALIBRATION_RUN, run)
    with (run / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"step": 31, "memory/above_runtime_bytes_max_rank": 2**30}) + "\n")
    check = answer(Question(cfg, 8, "h100", 1e11, calibrate_from=run, trials=50))["memory_check"]
    predicted = memory(Workload.of(load_config(run / "config.toml", []), param_dtype="fp32"),
                       Layout(dp_shard=2, micro_batch=16), by_key("cpu"))
    assert check["predicted_gib"] == pytest.approx(predicted.total / GIB) and check["measured_gib"] == 1.0
    assert check["error"] == pytest.approx(predicted.total / GIB - 1) and check["layout"] == "dp_shard2 mb16"
    assert check["note"] == "profiled: the profiler's buffers are in the measured peak"
