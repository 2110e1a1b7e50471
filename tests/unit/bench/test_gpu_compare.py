"""bench/gpu_check.py's comparison with a bare loop and torchtitan: the variant table, torchtitan's spec from a
keel config and its log parsed, the ratios, and the 3B config's shapes."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import gpu_variants, titan_run
from bench.gpu_variants import Variant
from keel.config import load_config
from keel.model.flops import ffn_hidden_dim, flops_per_token, param_count

REPO = Path(__file__).resolve().parents[3]


def test_gpu_3b_has_llama_3_2_3b_shapes_and_size() -> None:
    m = load_config(REPO / "configs" / "gpu_3b.toml").model
    assert (m.dim, m.n_layers, m.n_heads, m.n_kv_heads, ffn_hidden_dim(m), m.rope_theta, m.tie_embeddings) == (
        3072, 28, 24, 8, 8192, 500000.0, True)
    assert round(param_count(m) / 1e9, 2) == 3.21  # Llama 3.2 3B's published size


def test_every_shape_has_keel_bf16_fp8_bare_and_torchtitan_in_the_table() -> None:
    for shape in gpu_variants.SHAPES:
        runners = {(v.runner, "train.precision=fp8" in v.overrides) for v in gpu_variants.VARIANTS
                   if v.shape == shape}
        assert {("keel", False), ("keel", True), ("bare", False), ("torchtitan", False)} <= runners
    names = [v.name for v in gpu_variants.VARIANTS]
    assert len(names) == len(set(names))
    assert all(v.runner in gpu_variants.RUNNERS for v in gpu_variants.VARIANTS)


def test_compile_modes_leave_out_only_the_variant_that_exists_for_the_other_mode() -> None:
    eager, compiled, default = Variant("a", "1b", compile="off"), Variant("b", "1b", compile="on"), Variant("c", "1b")
    assert [v.compiled("both") for v in (eager, compiled, default)] == [False, True, True]
    assert [v.compiled("off") for v in (eager, compiled, default)] == [False, None, False]
    assert [v.compiled("on") for v in (eager, compiled, default)] == [None, True, True]


def test_only_selects_by_name_or_shape_and_rejects_the_unknown() -> None:
    assert {v.shape for v in gpu_variants.select("3b")} == {"3b"}
    assert [v.name for v in gpu_variants.select("1b bare, 3b keel")] == ["1b bare", "3b keel"]
    with pytest.raises(ValueError, match="no variant or shape 2b"):
        gpu_variants.select("2b")


def test_fastpath_selects_the_defaults_and_one_valid_run_per_option_each_with_its_ratio() -> None:
    chosen = gpu_variants.select("fastpath")
    assert [v.name for v in chosen] == ["1b keel", *(f"1b keel {name}" for name in gpu_variants.FAST_PATH)]
    for v in chosen[1:]:  # each option is a valid config of the 1.24B shape, compiled as it needs
        load_config(REPO / "configs" / "gpu_1b.toml", [*v.overrides, "parallel.compile=true"])
    runs = {"1b keel": {"figures": {"tokens_per_s": 50.0}}, "1b keel fused ce": {"figures": {"tokens_per_s": 55.0}}}
    values, _ = gpu_variants.ratios(runs, {})
    assert values["1b fused ce/default"] == pytest.approx(1.1) and "3b fused ce/default" not in values


def test_ratios_divide_tokens_per_s_of_the_same_shape_and_say_why_one_is_missing() -> None:
    runs = {name: {"figures": {"tokens_per_s": tps}} for name, tps in
            [("1b keel", 60_000.0), ("1b torchtitan", 50_000.0), ("1b bare", 64_000.0), ("1b keel fp8", 75_000.0)]}
    values, why = gpu_variants.ratios(runs, {"3b torchtitan": "torchtitan is not installed"})
    assert values["1b keel/torchtitan"] == pytest.approx(1.2)
    assert values["1b keel/bare"] == pytest.approx(0.9375)
    assert values["1b fp8/bf16"] == pytest.approx(1.25)
    assert values["3b keel/torchtitan"] is None
    assert "3b torchtitan: torchtitan is not installed" in why["3b keel/torchtitan"]
    assert "3b keel: no tokens/s" in why["3b keel/torchtitan"] and not set(why) & {"1b keel/bare"}


def test_the_time_estimate_grows_with_steps_and_falls_with_compilation() -> None:
    cfg = load_config(REPO / "configs" / "gpu_1b.toml")
    per_step = flops_per_token(cfg.model, 2048) * 16 * 2048
    keel = Variant("1b keel", "1b")
    compiled = gpu_variants.estimate_s(keel, 20, per_step, 989.5e12, True)
    # 20 steps at 45% of an H200's peak: 0.6 s each, beside the run's start-up and compile.
    assert compiled == pytest.approx(gpu_variants.OVERHEAD_S[("keel", "1b")] + 20 * 0.605, abs=0.1)
    assert gpu_variants.estimate_s(keel, 20, per_step, 989.5e12, False) > compiled
    assert gpu_variants.estimate_s(keel, 40, per_step, 989.5e12, True) > compiled


@pytest.mark.parametrize(("config", "flavour"), [("gpu_1b", "1B"), ("gpu_3b", "3B")])
def test_torchtitan_spec_names_the_flavour_of_the_same_shapes_and_keels_run(config: str, flavour: str,
                                                                          tmp_path: Path) -> None:
    cfg = load_config(REPO / "configs" / f"{config}.toml", ["train.steps=20", "monitor.interval=5"])
    spec = titan_run.spec(cfg, tmp_path, compile_on=True)
    assert spec["flavor"] == flavour
    m = cfg.model
    assert (spec["dim"], spec["n_layers"], spec["n_heads"], spec["n_kv_heads"], spec["ffn_hidden"],
            spec["vocab_size"], spec["tie_embeddings"]) == titan_run.FLAVOURS[flavour] == (
        m.dim, m.n_layers, m.n_heads, m.n_kv_heads, ffn_hidden_dim(m), m.vocab_size, m.tie_embeddings)
    assert (spec["seq_len"], spec["micro_batch"], spec["global_batch"], spec["steps"], spec["log_freq"]) == (
        2048, 4, 16, 20, 5)
    assert spec["compile"] is True and spec["dump_folder"] == str(tmp_path)
    command = titan_run.command(tmp_path / "spec.json")
    assert command[1:3] == ["-m", "torch.distributed.run"] and command[-2:] == [str(titan_run.ENTRY),
                                                                                 str(tmp_path / "spec.json")]


def test_torchtitan_spec_refuses_shapes_it_has_no_flavour_of(tmp_path: Path) -> None:
    for overrides in (["model.n_layers=15"], ["model.moe.experts=8", "model.moe.top_k=2"]):
        cfg = load_config(REPO / "configs" / "gpu_1b.toml", overrides)
        with pytest.raises(ValueError, match="no Llama 3 flavour"):
            titan_run.spec(cfg, tmp_path, compile_on=True)


def test_torchtitan_log_lines_are_parsed_and_summarised_after_the_first_window() -> None:
    log = "\n".join([
        "[titan] 2026-12-05 17:40:00,000 - root - INFO - Building llama3 1B",
        "[titan] 2026-12-05 17:40:05,000 - root - INFO - step:  5  loss: 11.93000  grad_norm:  4.0000  "
        "memory: 50.10GiB(35.28%)  tps: 9,876  tflops: 81.20  mfu: 8.21%",
        titan_run.SAMPLE_LOG,
        "[titan] 2026-12-05 17:40:15,000 - root - INFO - step: 15  loss:  9.00000  grad_norm:  1.0000  "
        "memory: 47.00GiB(33.10%)  tps: 57,500  tflops: 472.00  mfu: N/A"])
    logged = titan_run.windows(log)
    assert [w["step"] for w in logged] == [5, 10, 15]
    assert logged[1]["tokens_per_s"] == 57_312 and logged[1]["titan_mfu"] == pytest.approx(0.4761)
    assert logged[2]["titan_mfu"] is None and logged[0]["peak_reserved_bytes"] == pytest.approx(50.10 * 2**30)
    got = titan_run.summary(logged)
    assert got["tokens_per_s"] == pytest.approx((57_312 + 57_500) / 2)  # the compile window left out
    assert got["peak_reserved_bytes"] == pytest.approx(50.10 * 2**30)  # torchtitan resets it after each line
    assert got["titan_mfu"] == pytest.approx(0.4761) and got["windows"] == 3
    assert titan_run.summary([])["tokens_per_s"] is None


def test_torchtitan_is_not_tried_without_cuda_or_without_the_package() -> None:
    why = titan_run.unavailable(cuda=False)
    assert "not installed" in why or "CUDA device only" in why
