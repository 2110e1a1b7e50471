"""The cluster's own figures in `keel plan`: a TOML file and flags (flags win), each checked in one line; the
network, detection, restart and repair times reach the predictions; spare nodes only where they pay."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from keel.config import load_config
from keel.errors import KeelError
from keel.plan.cluster import Cluster, cluster_from, write_cluster
from keel.plan.failure_rates import TRIAGE_H
from keel.plan.failures import FailureMix, Recovery
from keel.plan.layout import Layout, Workload
from keel.plan.layouts import search
from keel.plan.report import Question, answer, hardware, lines
from keel.plan.throughput import measured_run, step_time

REPO = Path(__file__).resolve().parents[3]
RUN = Path(__file__).parent / "calibration_run"  # a real 2-process CPU run (test_throughput.py)


def question(gpus: int, cluster: Cluster, config: str = "llama3_8b", tokens: float = 1e11) -> Question:
    cfg = load_config(REPO / "configs" / f"{config}.toml", [])
    return Question(cfg, gpus, "h100", tokens, price=cluster.price, storage_gbs=cluster.storage_gbps,
                    mtbf_hours=cluster.mtbf_hours, net_gbps=cluster.net_gbps, recovery=cluster.recovery(),
                    mix=cluster.mix(), silent_detect_s=cluster.silent_detect_s, spares=cluster.spares,
                    memory_coverage=cluster.memory_coverage, trials=200)


def test_a_cluster_file_gives_the_figures_and_flags_win_over_it(tmp_path: Path) -> None:
    path = tmp_path / "cluster.toml"
    path.write_text("net_gbps = 25\ndetect_s = 600\nrestart_s = 900\nrepair_h = 48\nspares = 2\nmtbf_hours = 14000\n")
    cluster = cluster_from(path, {"restart_s": 60.0, "spares": "auto", "detect_s": None})
    assert cluster == Cluster(net_gbps=25.0, detect_s=600.0, restart_s=60.0, repair_h=48.0, spares=None,
                              mtbf_hours=14000.0)
    assert cluster.recovery() == Recovery(detect_s=600.0, restart_s=60.0, repair_s=48 * 3600.0,
                                          triage_s=TRIAGE_H * 3600)
    assert cluster_from(None, {}) == Cluster()  # the documented defaults


@pytest.mark.parametrize("text, message", [
    ("net_gbs = 25\n", "unknown figure 'net_gbs'; expected some of net_gbps, fabric_devices, detect_s"),
    ("repair_h = -1\n", "repair_h = -1: expected a finite number at least 0"),
    ("net_gbps = 'fast'\n", "net_gbps = 'fast': expected a finite number above 0"),
    ("spares = 1.5\n", "spares = 1.5: expected auto or a number of spare nodes"),
    ("fragmentation = 1.5\n", "fragmentation = 1.5: expected a finite number at least 0 and at most 1"),
    ("memory_coverage = 1.2\n", "memory_coverage = 1.2: expected a finite number at least 0 and at most 1"),
    ("detect_s = \n", "not valid TOML"),
    ("hang_share = 2\n", "hang_share = 2: expected a finite number at least 0 and at most 1"),
    ("triage_h = -3\n", "triage_h = -3: expected a finite number at least 0"),
    ("gemm_efficiency = 1.5\n", "gemm_efficiency = 1.5: expected a finite number above 0 and at most 1"),
    ("attention_backward_efficiency = 0\n", "attention_backward_efficiency = 0: expected a finite number above 0"),
    ("fabric_devices = 0\n", "fabric_devices = 0: expected a finite number at least 1"),
    ("fabric_devices = 7.5\n", "fabric_devices = 7.5: expected a finite number at least 1 .*a whole number"),
])
def test_a_bad_cluster_file_is_one_line(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "cluster.toml"
    path.write_text(text)
    with pytest.raises(KeelError, match=message.replace("(", r"\(").replace(")", r"\)")) as caught:
        cluster_from(path, {})
    assert "\n" not in str(caught.value) and str(path) in str(caught.value)


def test_recovery_times_and_the_network_reach_the_prediction() -> None:
    base = answer(question(1024, Cluster(spares=1), tokens=1e13))  # two weeks, a failure every two days
    slow = answer(question(1024, Cluster(spares=1, detect_s=1800, restart_s=3600), tokens=1e13))
    assert slow["run"]["expected_goodput"] < base["run"]["expected_goodput"] - 0.01
    assert slow["run"]["wall_days"]["mean"] > base["run"]["wall_days"]["mean"] + 0.1
    assert (slow["question"]["detect_s"], slow["question"]["restart_s"]) == (1800, 3600)
    thin = answer(question(1024, Cluster(spares=1, net_gbps=3.125), tokens=1e13))  # 25 Gb/s per GPU instead of 400
    assert thin["question"]["net_gb_s"] == 3.125 and base["question"]["net_gb_s"] == 50
    assert thin["layouts"][0]["tokens_per_s_per_gpu"] < base["layouts"][0]["tokens_per_s_per_gpu"]


def test_how_failures_show_comes_from_the_file_and_reaches_the_forecast(tmp_path: Path) -> None:
    path = tmp_path / "cluster.toml"
    path.write_text("hang_share = 0.3\nhang_detect_s = 1800\nsilent_detect_s = 60\nmanual_share = 0.2\n"
                    "triage_h = 8\nrollbacks_per_day = 1\n")
    cluster = cluster_from(path, {})
    assert cluster.mix() == FailureMix(hang=0.3, silent=cluster.silent_share, manual=0.2, rollbacks_per_day=1.0)
    assert cluster.recovery().hang_detect_s == 1800 and cluster.recovery().triage_s == 8 * 3600
    slow = answer(question(1024, cluster, tokens=1e13))
    base = answer(question(1024, Cluster(), tokens=1e13))
    assert slow["question"]["silent_detect_s"] == 60 and slow["question"]["failure_mix"]["manual"] == 0.2
    assert base["question"]["silent_detect_s"] != 60  # keel's guard latency at the planned step
    assert slow["question"]["rollback_s"] > 0
    assert slow["run"]["expected_goodput"] < base["run"]["expected_goodput"] - 0.01
    path.write_text("hang_share = 0.7\nsilent_share = 0.6\n")
    with pytest.raises(KeelError, match=f"--cluster {path}: hang_share 0.7 \\+ silent_share 0.6 exceed every"):
        cluster_from(path, {})


def test_the_clusters_kernel_figures_replace_the_generations_and_reach_the_step(tmp_path: Path) -> None:
    path = tmp_path / "cluster.toml"
    path.write_text("gemm_efficiency = 0.6\nattention_forward_efficiency = 0.5\nmemory_efficiency = 0.7\n")
    cluster = cluster_from(path, {})
    assert cluster.kernel_figures() == {"gemm": 0.6, "attention_forward": 0.5, "memory": 0.7}
    q = question(64, Cluster(), tokens=1e11)
    base, given = answer(q), answer(replace(q, kernel_figures=tuple(cluster.kernel_figures().items())))
    k = given["kernels"]
    assert (k["gemm"], k["attention_forward"]) == (0.6, 0.5)
    assert k["attention_backward"] == base["kernels"]["attention_backward"]  # the generation's, not given
    assert k["source"].startswith("the cluster file's attention_forward, gemm, memory")
    # GEMMs at 60% of the peak instead of 80%: every layout slower, the best by most of that.
    assert given["layouts"][0]["tokens_per_s_per_gpu"] < 0.85 * base["layouts"][0]["tokens_per_s_per_gpu"]
    assert any(line.endswith("(the cluster file's figures)") for line in lines(given))


def test_the_clusters_fabric_joins_nodes_and_reaches_the_links_and_the_search(tmp_path: Path) -> None:
    path = tmp_path / "cluster.toml"
    path.write_text("fabric_devices = 16\n")  # an NVLink switch system joining two nodes of 8
    cluster = cluster_from(path, {})
    q = question(64, Cluster(), tokens=1e11)
    hw, joined = hardware(q), hardware(replace(q, fabric_devices=cluster.fabric_devices))
    assert (hw.fabric(), joined.fabric(), joined.devices_per_node) == (8, 16, 8)
    work = Workload.of(q.cfg)
    heads = replace(work, model=replace(work.model, n_kv_heads=work.model.n_heads))  # tp up to its 32 heads
    # FSDP over 16 ranks: two nodes' NICs, or one fabric's NVLink.
    fsdp = Layout(dp_shard=16, dp_replicate=4)
    assert step_time(work, fsdp, joined).fsdp_comm < step_time(work, fsdp, hw).fsdp_comm / 5
    assert {c.layout.tp for c in search(heads, 64, joined)} - {c.layout.tp for c in search(heads, 64, hw)} == {16}


def test_the_allocators_fragmentation_decides_what_fits() -> None:
    """torchtitan's 8B layout with full AC on 8 H100: its allocated peak leaves room for 5% fragmentation,
    not for 70%."""
    cfg = load_config(REPO / "configs" / "llama3_8b.toml", [])
    layout = "dp_shard=8,micro_batch=2,ac=full"
    tight = answer(Question(cfg, 8, "h100", 1e11, layout=layout, trials=50))
    loose = answer(Question(cfg, 8, "h100", 1e11, layout=layout, trials=50, fragmentation=0.7))
    assert tight["question"]["fragmentation"] == 0.05 and tight["given"]["fits"]
    assert loose["memory"]["total"] == tight["memory"]["total"]
    assert loose["memory"]["reserved"] == pytest.approx(1.7 * loose["memory"]["total"]) and not loose["given"]["fits"]


def test_spares_are_kept_only_where_they_pay_for_themselves() -> None:
    small = answer(question(8, Cluster()))
    assert small["spares"]["auto"] and small["spares"]["nodes"] == 0  # a spare would double an 8-GPU job's bill
    assert small["cost"]["parts"]["failures.spares"]["share"] == 0
    large = answer(question(16384, Cluster(), "llama3_405b", 15e12))
    options = {o["spares"]: o["money"] for o in large["spares"]["options"]}
    chosen = large["spares"]["nodes"]
    assert chosen > 0 and options[chosen] == min(options.values()) and options[0] > 1.5 * options[chosen]
    fixed = answer(replace(question(8, Cluster(spares=3))))
    assert fixed["spares"] == {"nodes": 3, "auto": False, "options": []}
    assert fixed["cost"]["parts"]["failures.spares"]["share"] > 0.5  # 3 idle nodes beside 1 working one


def test_the_memory_tiers_coverage_decides_its_forecast() -> None:
    """p_m from the cluster's figures: a tier that restores no failure is never worth a save, and one that
    restores them all gains more than the default's."""
    none, default, full = (answer(question(1024, Cluster(spares=1, memory_coverage=p), tokens=1e13))["tiers"]
                           for p in (0.0, Cluster().memory_coverage, 1.0))
    assert (none["coverage"], full["coverage"]) == (0.0, 1.0) and default["coverage"] == pytest.approx(1 - 35 / 419)
    assert none["two_tier"]["memory_interval_s"] is None and none["goodput_gain"] == pytest.approx(0.0, abs=1e-9)
    assert full["goodput_gain"] > default["goodput_gain"] > 0


def test_a_measured_cluster_file_gives_the_next_plan_its_factors_peak_and_links(tmp_path: Path) -> None:
    cfg = load_config(RUN / "config.toml", [])
    calibrated = answer(Question(cfg, 2, "cpu", 1e7, calibrate_from=RUN, trials=20))
    eff, run = calibrated["efficiency"], measured_run(RUN)
    measured = Cluster(compute_efficiency=eff["compute"], overlap=eff["overlap"], link_efficiency=eff["link"],
                       peak_tflops=run.hw.peak_flops["fp32"] / 1e12, intra_gbps=run.hw.intra_bw / 1e9,
                       net_gbps=run.hw.inter_bw / 1e9)
    path = write_cluster(tmp_path / "cluster.toml", measured, {"overlap": "fitted"})
    assert "overlap = " in path.read_text() and "# fitted" in path.read_text()
    cluster = cluster_from(path, {})
    assert cluster == measured
    plan = answer(Question(cfg, 2, "cpu", 1e7, net_gbps=cluster.net_gbps, efficiency=cluster.efficiency(),
                           peak_tflops=cluster.peak_tflops, intra_gbps=cluster.intra_gbps, trials=20))
    assert [r["step_s"] for r in plan["layouts"]] == pytest.approx([r["step_s"] for r in calibrated["layouts"]])


def test_measured_figures_are_checked_and_the_factors_come_together(tmp_path: Path) -> None:
    path = tmp_path / "cluster.toml"
    path.write_text("compute_efficiency = 0.4\n")
    with pytest.raises(KeelError, match="give all three or none"):
        cluster_from(path, {}).efficiency()
    path.write_text("overlap = 1.5\n")
    with pytest.raises(KeelError, match="overlap = 1.5: expected a finite number at least 0 and at most 1"):
        cluster_from(path, {})
    cfg = load_config(REPO / "configs" / "llama3_8b.toml", [])
    with pytest.raises(KeelError, match="H100 .* has a published peak"):
        answer(Question(cfg, 8, "h100", 1e11, peak_tflops=500.0, trials=20))
