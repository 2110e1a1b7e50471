"""The throughput model (alpha-beta collectives, bubble, recompute, overlap), its calibration on a real
keel run, its predictions of published runs with the default efficiency factors, and the layout search."""

from __future__ import annotations

import json
import math
import shutil
import statistics
import time
from dataclasses import replace
from pathlib import Path

import pytest

from keel.config import ModelConfig, load_config
from keel.core.accelerators import by_key
from keel.errors import KeelError
from keel.model.flops import attention_flops_per_token
from keel.plan.kernels import CAUSAL_SHARE
from keel.plan.layout import Layout, Workload
from keel.plan.layouts import explain, search
from keel.plan.report import Question, answer, lines
from keel.plan.throughput import (
    BASE_LATENCY,
    DEFAULT,
    HOP_INTER,
    HOP_INTRA,
    Efficiency,
    _link,
    calibrate,
    collective,
    efficiency_for,
    measured_run,
    step_time,
)
from tests.conftest import REPO

RUN = Path(__file__).parent / "calibration_run"
H100 = by_key("h100")
A100 = by_key("a100")
EXACT = Efficiency(compute=1.0, overlap=0.0, link=1.0)


def model(name: str) -> ModelConfig:
    return load_config(REPO / "configs" / f"{name}.toml", []).model


def test_ring_collectives_move_their_share_of_the_buffer() -> None:
    link = _link(H100, 1, 8, EXACT)
    assert link.nodes == 1 and link.bandwidth == H100.intra_bw
    size = 1e9
    gather = collective("all_gather", size, 8, link)
    assert gather == pytest.approx(BASE_LATENCY + 7 * HOP_INTRA + 7 / 8 * size / H100.intra_bw)
    assert collective("reduce_scatter", size, 8, link) == gather
    reduce = collective("all_reduce", size, 8, link)
    assert reduce == pytest.approx(BASE_LATENCY + 14 * HOP_INTRA + 2 * 7 / 8 * size / H100.intra_bw)
    assert collective("all_reduce", size, 1, link) == 0.0
    # Across 4 nodes the ring runs at the NIC's bandwidth and 3 of its steps pay the network's latency.
    wide = _link(H100, 8, 4, EXACT)
    assert wide.nodes == 4 and wide.bandwidth == H100.inter_bw
    assert collective("all_gather", size, 4, wide) == pytest.approx(
        BASE_LATENCY + 3 * HOP_INTER + 3 / 4 * size / H100.inter_bw)


@pytest.mark.parametrize(("stride", "size", "nodes"), [
    (1, 8, 1),  # tp 8: one node
    (1, 16, 2),  # dp_shard 16, no tp: two nodes of 8
    (2, 4, 1),  # dp_shard 4 inside tp 2: 8 ranks, one node
    (8, 32, 32),  # dp_shard 32 outside tp 8: one member per node
    (4, 4, 2),  # 16 ranks from stride 4: two nodes
])
def test_a_group_uses_the_node_fabric_only_when_its_span_fits_a_node(stride: int, size: int, nodes: int) -> None:
    link = _link(H100, stride, size, EXACT)
    assert link.nodes == nodes
    assert link.bandwidth == (H100.intra_bw if nodes == 1 else H100.inter_bw)


@pytest.mark.parametrize(("key", "stride", "size", "fabrics"), [
    ("gb200", 1, 16, 1),  # tp 16 over 4 trays of one NVL72 rack: NVLink
    ("gb200", 16, 8, 2),  # 128 ranks from stride 16: two racks, over the network
    ("tpu-v4", 1, 12, 1),  # PaLM's tp 12 over 3 hosts of one slice: ICI
    ("tpu-v4", 3072, 2, 2),  # data parallelism across two slices of 3,072: the data-centre network
])
def test_a_scale_up_fabric_that_spans_hosts_carries_the_groups_inside_it(key: str, stride: int, size: int,
                                                                          fabrics: int) -> None:
    hw = by_key(key)
    if key == "tpu-v4":
        hw = replace(hw, fabric_devices=3072)  # PaLM's slices
    link = _link(hw, stride, size, EXACT)
    assert hw.fabric() > hw.devices_per_node and link.nodes == fabrics
    assert link.bandwidth == (hw.intra_bw if fabrics == 1 else hw.inter_bw)
    # A host's devices are what fails and is spared together; the fabric decides only the links.
    assert replace(hw, fabric_devices=0).fabric() == hw.devices_per_node


def test_tensor_parallelism_is_searched_over_the_fabric_not_the_host() -> None:
    small = model("small")
    work = Workload(replace(small, n_kv_heads=small.n_heads), seq_len=256, global_batch=64)
    assert {c.layout.tp for c in search(work, 16, by_key("tpu-v5p"))} == {1, 2, 4, 8}  # hosts of 4, one slice


def test_activation_checkpointing_adds_recomputed_forwards() -> None:
    work = Workload(model("llama3_8b"), 8192, 64)
    base = Layout(dp_shard=8, micro_batch=1)
    none = step_time(work, base, H100).compute
    full = step_time(work, replace(base, ac="full"), H100).compute
    # One more forward of every block (a third of its training FLOPs; the output projection is not recomputed),
    # and keel's selective half of it: every second block.
    assert none * 1.25 < full < none * 4 / 3
    assert step_time(work, replace(base, ac="selective"), H100).compute == pytest.approx((none + full) / 2)
    assert step_time(work, replace(base, ac="full"), H100).hfu == pytest.approx(
        step_time(work, replace(base, ac="full"), H100).mfu * 4 / 3)


def test_the_breakdown_adds_up_and_mfu_follows_from_tokens_per_second() -> None:
    work = Workload(model("llama3_70b"), 8192, 512)
    layout = Layout(tp=8, pp=4, v=2, dp_shard=4, dp_replicate=2, micro_batch=1, ac="selective")
    step = step_time(work, layout, H100)
    assert sum(step.parts().values()) == pytest.approx(step.total)
    assert step.total == pytest.approx(step.compute + step.bubble + step.exposed_comm)
    assert step.tokens_per_s_per_device * step.total * layout.gpus() == pytest.approx(512 * 8192)
    assert step.mfu == pytest.approx(step.tokens_per_s_per_device * work.flops_per_token / H100.peak_flops["bf16"])
    assert min(step.tp_comm, step.fsdp_comm, step.dp_comm, step.pp_p2p, step.bubble) > 0
    assert "tokens/s/device" in step.explain()


def test_the_bubble_is_p_minus_1_over_m_plus_p_minus_1_and_interleaving_divides_it_by_v() -> None:
    work = Workload(model("llama3_8b"), 8192, 32)
    layout = Layout(pp=4, micro_batch=1)  # 32 micro-batches, nothing else to communicate but p2p
    step = step_time(work, layout, H100)
    busy = step.compute + step.tp_comm + step.pp_p2p
    assert step.bubble == pytest.approx(busy * 3 / 32)
    assert step.bubble / (step.bubble + busy) == pytest.approx(3 / (32 + 3))
    interleaved = step_time(work, replace(layout, v=2), H100)
    assert interleaved.bubble == pytest.approx((interleaved.compute + interleaved.tp_comm + interleaved.pp_p2p)
                                               * 3 / (2 * 32))
    assert interleaved.pp_p2p == pytest.approx(2 * step.pp_p2p)  # every chunk boundary is crossed


def test_each_pipeline_schedule_idles_its_own_share_of_the_step() -> None:
    work = Workload(model("llama3_8b"), 8192, 32)
    one = step_time(work, Layout(pp=4, micro_batch=1), H100)
    assert step_time(work, Layout(pp=4, micro_batch=1, schedule="gpipe"), H100).bubble == pytest.approx(one.bubble)
    interleaved = step_time(work, Layout(pp=4, v=2, micro_batch=1), H100)
    zero = step_time(work, Layout(pp=4, v=2, micro_batch=1, schedule="interleaved_zb"), H100)
    assert zero.bubble == pytest.approx(interleaved.bubble / 3)  # the weights' backward fills two thirds of it
    assert zero.total == pytest.approx(interleaved.total - 2 / 3 * interleaved.bubble)


def test_tp_costs_the_bytes_of_two_all_reduces_per_layer_each_way() -> None:
    work = Workload(model("llama3_8b"), 8192, 8)
    layout = Layout(tp=8, micro_batch=1)
    act = 8192 * 4096 * 2
    link = _link(H100, 1, 8, DEFAULT)
    pair = collective("all_gather", act, 8, link) + collective("reduce_scatter", act, 8, link)
    assert step_time(work, layout, H100).tp_comm == pytest.approx(32 * 8 * 2 * pair)
    assert step_time(work, replace(layout, ac="full"), H100).tp_comm == pytest.approx(32 * 8 * 3 * pair)


def test_overlap_hides_fsdp_traffic_but_never_more_than_the_compute() -> None:
    work = Workload(model("llama3_8b"), 8192, 256)
    layout = Layout(dp_shard=128, micro_batch=2, ac="selective")
    exposed = step_time(work, layout, H100, replace(DEFAULT, overlap=0.0))
    assert exposed.exposed_comm == pytest.approx(exposed.fsdp_comm)
    hidden = step_time(work, layout, H100, replace(DEFAULT, overlap=1.0))
    assert hidden.exposed_comm == pytest.approx(0.0, abs=1e-12)
    slow = replace(H100, inter_bw=H100.inter_bw / 100)  # traffic far beyond the compute
    capped = step_time(work, layout, slow, replace(DEFAULT, overlap=1.0))
    assert capped.exposed_comm == pytest.approx(capped.fsdp_comm - capped.compute)


def test_faster_links_and_more_overlap_never_slow_a_step() -> None:
    work = Workload(model("llama3_70b"), 8192, 512)
    for layout in (Layout(tp=8, dp_shard=32, micro_batch=1, ac="full"),
                   Layout(tp=4, pp=4, dp_shard=8, dp_replicate=2, micro_batch=2, ac="selective")):
        base = step_time(work, layout, H100).total
        assert step_time(work, layout, replace(H100, inter_bw=2 * H100.inter_bw)).total <= base
        assert step_time(work, layout, replace(H100, intra_bw=2 * H100.intra_bw)).total <= base
        assert step_time(work, layout, H100, replace(DEFAULT, overlap=1.0)).total <= base


def test_a_device_without_a_peak_is_refused() -> None:
    with pytest.raises(KeelError, match="no known bf16 peak"):
        step_time(Workload(model("llama3_8b"), 8192, 8), Layout(dp_shard=8), by_key("cpu"))


def test_the_published_model_shapes_match_their_papers() -> None:
    from bench.plan_validation import load
    from bench.plan_validation import model as published_model

    models = load()["models"]
    sizes = {"palm_540b": 540.35e9, "megatron_1t": 1008e9, "gpt3_175b": 175e9, "bloom_176b": 176.2e9}
    for name, size in sizes.items():
        m = published_model(models[name])
        # Models run in pipelines are untied there (Megatron keeps a copy of the embedding on the last stage).
        size += 0 if m.tie_embeddings else m.vocab_size * m.dim
        assert Workload(m, 2048, 1).n_params == pytest.approx(size, rel=0.01), name


def test_calibration_reproduces_the_measured_run() -> None:
    # A real run: `keel train --config configs/tiny.toml train.steps=30 monitor.profile_interval=5 --nproc 2`
    # on a 2-core CPU host (FSDP over 2 gloo ranks), its config.toml, metrics.jsonl and start/preflight events.
    run = measured_run(RUN)
    assert run.layout == Layout(dp_shard=2, micro_batch=16) and run.work.param_dtype == "fp32"
    assert run.hw.key == "cpu" and run.hw.intra_bw == pytest.approx(1.313e9, rel=0.01)
    eff = calibrate(RUN)
    assert 0.3 < eff.compute < 1.0 and 0.0 <= eff.overlap <= 1.0 and eff.link > 0
    predicted = step_time(run.work, run.layout, run.hw, eff)
    assert predicted.total == pytest.approx(run.step_s, rel=0.10)
    assert predicted.tokens_per_s_per_device * 2 == pytest.approx(run.tokens_per_s, rel=0.10)
    assert predicted.mfu == pytest.approx(run.mfu, rel=0.10)
    # Compute efficiency is the achieved MFU over the part of the step outside collectives, counting the FLOPs
    # the kernels compute: half of the causal attention's.
    computed = 1 - (1 - CAUSAL_SHARE) * attention_flops_per_token(run.work.model, run.work.seq_len) / \
        run.work.flops_per_token
    assert eff.compute == pytest.approx(run.mfu * computed * run.step_s / (run.step_s - run.comm_s), rel=0.02)


def test_a_cpu_is_planned_from_a_calibration_run_in_its_own_precision() -> None:
    # A CPU has no vendor peak: with --calibrate the plan takes the run's measured peak and all-reduce bandwidth,
    # and plans in fp32 as keel computes on a CPU (train.precision = auto). The run's own layout is then predicted
    # at the step time it measured (in bf16 its FSDP traffic would have been halved).
    cfg = load_config(RUN / "config.toml", [])
    with pytest.raises(KeelError, match="no known fp32 peak"):
        answer(Question(cfg, 2, "cpu", 1e7, trials=20))
    plan = answer(Question(cfg, 2, "cpu", 1e7, layout="dp_shard=2,micro_batch=16", calibrate_from=RUN, trials=20))
    run = measured_run(RUN)
    assert plan["given"]["step_s"] == pytest.approx(run.step_s, rel=0.10)
    assert plan["layouts"] and plan["question"]["hardware"] == "CPU host"


def test_calibration_follows_a_slower_run(tmp_path: Path) -> None:
    """The same run made twice as slow (step time doubled, throughput and MFU halved): the fitted
    factors change and still reproduce it."""
    run = tmp_path / "run"
    shutil.copytree(RUN, run)
    slower = []
    for line in (run / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "time/step_s" in record:
            record["time/step_s"] *= 2
            record["time/comm_s"] *= 2
            for key in ("throughput/tokens_per_s", "throughput/tflops_per_device", "throughput/mfu"):
                record[key] /= 2
        slower.append(json.dumps(record) + "\n")
    (run / "metrics.jsonl").write_text("".join(slower))
    fast, slow = calibrate(RUN), calibrate(run)
    assert slow.compute == pytest.approx(fast.compute / 2, rel=0.01)
    measured = measured_run(run)
    assert step_time(measured.work, measured.layout, measured.hw, slow).total == pytest.approx(
        2 * measured_run(RUN).step_s, rel=0.10)
    assert step_time(measured.work, measured.layout, measured.hw, fast).total < 0.6 * measured.step_s


def test_calibration_refuses_what_it_cannot_read(tmp_path: Path) -> None:
    with pytest.raises(KeelError, match="not a keel run directory"):
        calibrate(tmp_path)
    run = tmp_path / "run"
    shutil.copytree(RUN, run)
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    (run / "metrics.jsonl").write_text("".join(json.dumps({k: v for k, v in r.items() if "comm" not in k}) + "\n"
                                               for r in lines))
    with pytest.raises(KeelError, match="no profiled steps"):
        calibrate(run)


def test_search_over_1024_gpus_is_fast_ranked_and_complete() -> None:
    cfg = load_config(REPO / "configs" / "llama3_70b.toml", [])
    work = Workload(cfg.model, cfg.train.seq_len, cfg.train.global_batch)
    start = time.perf_counter()
    found = search(work, 1024, H100)
    assert time.perf_counter() - start < 2.0
    fitting = [c for c in found if c.fits]
    assert fitting and found[:len(fitting)] == fitting  # fitting first
    speeds = [c.tokens_per_s for c in fitting]
    assert speeds == sorted(speeds, reverse=True)
    for c in found:
        lay = c.layout
        assert lay.gpus() == 1024 and lay.tp <= 8 and cfg.model.n_kv_heads % lay.tp == 0
        assert work.global_batch % (lay.dp() * lay.micro_batch) == 0
        assert lay.pp * lay.v <= cfg.model.n_layers  # every stage holds a block (keel.model.split)
        assert lay.pp == 1 or work.micro_batches(lay) >= lay.pp
        assert c.memory.fits == c.fits and (c.fits or "does not fit" in c.why)
    assert {c.layout.ac for c in found} == {"none", "selective", "full"}
    assert {c.layout.v for c in found} > {1, 2, 4}  # and each v of Megatron-LM's whole blocks per stage:
    assert all(cfg.model.n_layers % (c.layout.pp * c.layout.v) == 0 for c in found if c.layout.v not in (1, 2, 4))
    # Micro-batches of every size dividing the per-rank batch, not only powers of two (llm-foundry's 6, 14, 18...).
    six = Workload(cfg.model, cfg.train.seq_len, 48)
    assert {c.layout.micro_batch for c in search(six, 8, H100) if c.layout.dp() == 8} == {1, 2, 3, 6}
    assert any(c.layout.dp_replicate > 1 for c in fitting)
    assert any(cfg.model.n_layers % (c.layout.pp * c.layout.v) for c in fitting)  # uneven splits are searched
    best = fitting[0]
    assert best.layout.tp == 8  # 70B over InfiniBand: tensor parallel over NVLink beats sharding wider


def test_explain_names_the_winner_and_the_alternatives_with_numbers() -> None:
    work = Workload(model("llama3_8b"), 8192, 256)
    lines = explain(search(work, 128, H100))
    assert lines[0].startswith("best: ") and "tokens/s/device" in lines[0] and "MFU" in lines[0]
    text = "\n".join(lines)
    assert "FSDP only: best is dp_shard128" in text
    assert "more TP (tp=" in text and "pipeline" in text
    assert all("%" in line for line in lines[2:-1])


def test_what_does_not_fit_is_kept_with_its_reason_and_explained() -> None:
    work = Workload(model("llama3_70b"), 8192, 8)
    found = search(work, 8, H100)
    fsdp_only = [c for c in found if c.layout == Layout(dp_shard=8, micro_batch=1)]
    assert fsdp_only and not fsdp_only[0].fits and "does not fit" in fsdp_only[0].why
    tiny = replace(H100, memory_bytes=8 * 2**30)
    lines = explain(search(work, 8, tiny))
    assert len(lines) == 1 and lines[0].startswith("no layout fits")


def test_a_batch_no_layout_divides_is_refused() -> None:
    with pytest.raises(KeelError, match="divides the global batch of 3 sequences"):
        search(Workload(model("llama3_8b"), 8192, 3), 64, H100)


def test_a_single_device_has_one_layout_per_micro_batch_and_checkpointing() -> None:
    work = Workload(model("llama3_8b"), 2048, 4)
    found = search(work, 1, replace(H100, memory_bytes=1e15))
    assert {c.layout.gpus() for c in found} == {1}
    assert len(found) == 3 * 3  # micro-batches 1, 2, 4 × three checkpointing modes
    assert found[0].layout.ac == "none" and math.isclose(found[0].step.exposed_comm, 0.0)


def test_float8_runs_the_blocks_linear_layers_at_the_float8_peak_and_pays_their_casts() -> None:
    """The blocks' linear layers at the float8 peak, the output projection and attention at bf16's; the casts
    of every operand at memory bandwidth keep the gain under the peaks' 2x."""
    bf16, fp8 = (Workload(model("llama3_8b"), 8192, 16, fp8=f) for f in (False, True))
    share = fp8.float8_flops_per_token / fp8.flops_per_token
    assert bf16.float8_flops_per_token == 0 and 0.6 < share < 0.8  # the 128k-vocabulary head and attention stay
    layout = Layout(dp_shard=8, micro_batch=2, ac="selective")
    ratio = step_time(bf16, layout, H100).total / step_time(fp8, layout, H100).total
    assert 1.2 < ratio < 1 / (1 - share / 2), ratio
    with pytest.raises(KeelError, match=r"train.precision = fp8 on NVIDIA A100.*no float8 matmuls") as caught:
        step_time(fp8, layout, A100)
    assert "\n" not in str(caught.value)
    # A config's precision reaches the plan, and the plan says so.
    cfg = load_config(REPO / "configs" / "llama3_8b.toml", ["train.precision=fp8"])
    planned = answer(Question(cfg, 8, "h100", 1e11, layout="dp_shard=8,micro_batch=2,ac=selective", spares=0,
                              trials=20))
    assert Workload.of(cfg).fp8 and planned["given"]["tokens_per_s_per_gpu"] == pytest.approx(
        step_time(Workload.of(cfg), layout, H100, efficiency_for(H100)).tokens_per_s_per_device)
    assert "72% of its FLOPs in float8" in lines(planned)[0]


def test_the_calibration_times_the_step_outside_the_windows_the_profiler_slowed(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(RUN, run_dir)
    config = (run_dir / "config.toml").read_text().replace("profile_interval = 5", "profile_interval = 20")
    (run_dir / "config.toml").write_text(config)
    windows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    windows = [r for r in windows if r.get("time/step_s") and r.get("throughput/mfu")][1:]
    clean = [r["time/step_s"] for r in windows if r["step"] % 20]  # windows of 10 steps: 20, 40 were profiled
    assert 0 < len(clean) < len(windows)
    assert measured_run(run_dir).step_s == pytest.approx(statistics.fmean(clean))
