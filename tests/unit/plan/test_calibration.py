"""`keel plan --calibrate-sweep`'s arithmetic: what the sweep's timings make of the planner's kernel and link
figures, and the shapes it times. (The sweep itself, run by real processes on this machine:
tests/dist/test_plan_calibration.py.)"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from keel.config import head_size, load_config
from keel.core.accelerators import by_key
from keel.errors import KeelError
from keel.plan.calibration import CPU, GPU, calibrate_sweep, fit, spec_for, sweep_device
from keel.plan.cluster import Cluster
from keel.plan.kernels import CAUSAL_SHARE, gemm_seconds, kernels_for, with_figures
from keel.plan.layout import Workload
from keel.plan.report import Question, answer, hardware
from keel.plan.throughput import GENERATIONS, MEASURED_KERNELS, _Link, collective, efficiency_for

REPO = Path(__file__).resolve().parents[3]
H100 = by_key("h100")
H100_MODEL = load_config(REPO / "configs" / "llama3_8b.toml", []).model
ATTENTION = {"batch": 2, "heads": 8, "kv_heads": 2, "head_dim": 128, "seq": 4096}
ATTENTION_FLOPS = 4 * 2 * 4096 * 4096 * 8 * 128 * CAUSAL_SHARE  # the forward's, as the step model counts them


def gemm(m: int, n: int, k: int, label: str, rate: float) -> dict:
    """A GEMM timing at `rate` FLOP/s."""
    return {"m": m, "n": n, "k": k, "label": label, "s": 2 * m * n * k / rate}


def rank(gemm_rates: tuple[float, float], seconds: dict[str, float], collective_s: list[dict]) -> dict:
    """One process's results as keel.plan.kernel_bench writes them: a square GEMM and one of the model's."""
    return {"device": "test", "gemm": [gemm(8192, 8192, 8192, "square 8192", gemm_rates[0]),
                                       gemm(4096, 1024, 512, "qkv", gemm_rates[1])],
            "gemm_fp8": [], "attention": {**ATTENTION, "forward_s": seconds["forward"],
                                          "backward_s": seconds["backward"]},
            "memory": {"bytes": 3 * 2**30, "s": seconds["memory"]}, "collectives": collective_s}


def moves(seconds: float) -> list[dict]:
    """The collectives of one process, all of 1 GiB, each taking `seconds`."""
    return [{"kind": kind, "bytes": 2**30, "s": seconds}
            for kind in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")]


def test_a_gpu_sweep_gives_each_kernel_its_share_of_the_published_peaks() -> None:
    peak = H100.peak_flops["bf16"]
    seconds = {"forward": ATTENTION_FLOPS / (0.6 * peak), "backward": 2 * ATTENTION_FLOPS / (0.45 * peak),
               "memory": 3 * 2**30 / (0.9 * H100.memory_bw)}
    ranks = [rank((0.75 * peak, 0.5 * peak), seconds, moves(0.01)) for _ in range(8)]
    fitted = fit(ranks, Workload(H100_MODEL, 4096, 256), H100, link=0.8)
    # The fastest GEMM gives the share a large one reaches; the model's smaller ones are the tile model's to time.
    assert fitted.kernels == pytest.approx({"gemm": 0.75, "attention_forward": 0.6, "attention_backward": 0.45,
                                            "memory": 0.9})
    # Each rank's link moved 7/8 of the gigabyte in 10 ms: over the link efficiency, the planner's NVLink figure.
    assert fitted.measured == pytest.approx({"intra_gbps": 7 / 8 * 2**30 / 0.01 / 0.8 / 1e9})
    # With those figures the step model times the square GEMM as it ran, and the all-gather within its latency.
    kern = with_figures(kernels_for(H100), fitted.kernels)
    square = next(r for r in fitted.rows if r["what"].startswith("square"))
    assert square["modelled_s"] == pytest.approx(gemm_seconds(8192, 8192, 8192, peak, H100.memory_bw, kern, 0.75))
    gathered = next(r for r in fitted.rows if r["part"] == "all_gather")
    wire = _Link(fitted.measured["intra_gbps"] * 1e9 * 0.8, 1)
    assert gathered["modelled_s"] == pytest.approx(collective("all_gather", 2**30, 8, wire))
    assert gathered["error"] == pytest.approx(gathered["modelled_s"] / 0.01 - 1)
    assert abs(gathered["error"]) < 0.01


def test_a_cpu_sweep_measures_its_own_peak_from_the_models_gemms_and_its_memory_bandwidth() -> None:
    cpu = by_key("cpu")
    ranks = [rank((4e11, 1e11), {"forward": 1.0, "backward": 4.0, "memory": 0.5}, moves(2.0)) for _ in range(2)]
    fitted = fit(ranks, Workload(H100_MODEL, 4096, 256, param_dtype="fp32"), cpu, link=0.8)
    # No published peak: the model's own GEMM (not the faster square one) sets it, and the memory bandwidth is
    # what the add reached; the processes' links are the host's, within and "across" nodes alike.
    assert fitted.measured == pytest.approx({"peak_tflops": 0.1, "memory_gbps": 3 * 2**30 / 0.5 / 1e9,
                                             "intra_gbps": 0.5 * 2**30 / 2.0 / 0.8 / 1e9,
                                             "net_gbps": 0.5 * 2**30 / 2.0 / 0.8 / 1e9})
    assert "gemm" not in fitted.kernels and fitted.kernels["memory"] == 1.0
    assert fitted.kernels["attention_forward"] == pytest.approx(min(1.0, ATTENTION_FLOPS / 1.0 / 1e11))


def test_each_kernel_is_the_median_process_and_each_collective_the_slowest() -> None:
    peak = H100.peak_flops["bf16"]
    seconds = {"forward": 1.0, "backward": 1.0, "memory": 1.0}
    ranks = [rank((share * peak, 0.1 * peak), seconds, moves(s))
             for share, s in ((0.5, 0.01), (0.7, 0.04), (0.8, 0.02))]
    fitted = fit(ranks, Workload(H100_MODEL, 4096, 256), H100, link=1.0)
    assert fitted.kernels["gemm"] == pytest.approx(0.7)
    assert [r["measured_s"] for r in fitted.rows if r["part"] == "all_gather"] == [0.04]
    assert fitted.measured["intra_gbps"] == pytest.approx(2 / 3 * 2**30 / 0.04 / 1e9)


def test_the_sweep_times_the_planned_models_own_gemms_and_attention() -> None:
    tiny = load_config(REPO / "configs" / "tiny.toml", ["train.micro_batch=4"])
    spec = spec_for(Workload.of(tiny), 4, "cpu", CPU)
    m, rows = tiny.model, 4 * tiny.train.seq_len
    hd = head_size(m)
    assert [g[:3] for g in spec["gemms"][len(CPU.squares):]][:2] == [
        [rows, (m.n_heads + 2 * m.n_kv_heads) * hd, m.dim], [rows, m.dim, m.n_heads * hd]]
    assert spec["gemms"][-1][:3] == [rows, m.vocab_size, m.dim]
    assert spec["attention"] == {"batch": 4, "heads": m.n_heads, "kv_heads": m.n_kv_heads, "head_dim": hd,
                                 "seq": tiny.train.seq_len}
    # A mixture of experts: each expert's GEMMs take its share of the routed rows, at the expert's width.
    moe = load_config(REPO / "configs" / "qwen3_30b_a3b.toml", [])
    gemms = {g[3]: g[:3] for g in spec_for(Workload.of(moe), 1, "cuda", GPU)["gemms"]}
    assert gemms["ffn in"] == [4096 * 8 // 128, 2 * 768, 2048]
    # A long sequence is timed on at most max_rows tokens: its kernels' shares, not minutes of one attention.
    long = load_config(REPO / "configs" / "llama3_8b.toml", ["train.seq_len=131072", "model.max_seq_len=131072"])
    spec = spec_for(Workload.of(long), 2, "cuda", GPU)
    assert spec["attention"]["seq"] == GPU.max_rows and spec["attention"]["batch"] == 1
    assert {g[0] for g in spec["gemms"][len(GPU.squares):]} == {GPU.max_rows}


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_a_gpu_sweep_on_a_machine_without_one_is_refused_before_anything_runs() -> None:
    with pytest.raises(KeelError, match="no CUDA device; run the sweep on a node of the cluster"):
        sweep_device(H100)
    assert sweep_device(by_key("cpu")) == ("cpu", 0)


def test_a_cpu_sweep_of_more_processes_than_the_host_can_take_is_refused_before_anything_runs(tmp_path) -> None:
    cores = os.cpu_count() or 1
    with pytest.raises(KeelError, match=f"would start {4 * cores + 1} on this host's {cores} cores"):
        calibrate_sweep(Workload(H100_MODEL, 4096, 256), 1, by_key("cpu"), 4 * cores + 1, Cluster(), tmp_path,
                        print)
    assert not any(tmp_path.iterdir())


def test_measured_kernels_on_hardware_without_published_runs_get_the_median_generations_step_share() -> None:
    # The median of 0.902, 0.821, 0.760 and 0.684.
    assert pytest.approx((0.821 + 0.760) / 2) == MEASURED_KERNELS
    cpu = by_key("cpu")
    assert efficiency_for(cpu).compute == 0.52
    assert efficiency_for(cpu, kernels_measured=True).compute == MEASURED_KERNELS
    assert efficiency_for(H100, kernels_measured=True).compute == GENERATIONS["hopper"][0]


def test_a_measured_memory_bandwidth_is_refused_where_the_catalog_publishes_one() -> None:
    cfg = load_config(REPO / "configs" / "tiny.toml", [])
    assert hardware(Question(cfg, 2, "cpu", 1e6, memory_gbps=12.5)).memory_bw == 12.5e9
    with pytest.raises(KeelError, match="memory_gbps = 3000: .* has a published memory bandwidth"):
        hardware(replace(Question(cfg, 8, "h100", 1e6), memory_gbps=3000.0))


def test_a_cpu_plan_without_a_known_network_is_refused_in_one_line() -> None:
    """One process measures no link: the failure model's copies to a peer have no bandwidth to run at."""
    cfg = load_config(REPO / "configs" / "tiny.toml", [])
    alone = Question(cfg, 1, "cpu", 1e6, peak_tflops=0.05, memory_gbps=10.0)
    with pytest.raises(KeelError, match=r"^--hardware cpu: the network between its nodes is unknown .* pass "
                                        r"--net-gbps, or measure it on 2 or more processes"):
        answer(alone)
    assert answer(replace(alone, net_gbps=1.0))["layouts"]
