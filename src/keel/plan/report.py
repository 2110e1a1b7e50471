"""`keel plan`: the planner's parts put together for one question (a model, a token budget, a cluster),
answered as a table, as JSON, or as an HTML page of plots."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from html import escape
from pathlib import Path

from keel.config import Config
from keel.core.accelerators import Accelerator, by_key
from keel.errors import KeelError
from keel.plan.cost import DEFAULT_PRICE_PER_HOUR, best_spares, cost_of, money_percentiles
from keel.plan.failure_rates import PUBLISHED_MIX, TRIAGE_H, device_mtbf_hours, failures_source, guard_latencies
from keel.plan.failures import (
    DEFAULT_MEMORY_COVERAGE,
    FailureMix,
    FailureModel,
    Policy,
    Recovery,
    Run,
    SimResult,
    Storage,
    checkpoint_bytes,
    compare_policies,
    expected_goodput,
    replication,
    save_times,
    young_daly,
)
from keel.plan.kernels import kernels_for, with_figures
from keel.plan.layout import SOFTWARE, Layout, Workload, config_layout, parse_layout
from keel.plan.layouts import Candidate, assess, explain, search, untied_alternative
from keel.plan.memory import GIB, PARTS, check_run, suggest
from keel.plan.throughput import (
    Efficiency,
    StepBreakdown,
    calibrate,
    efficiency_for,
    ep_exchange,
    ep_link,
    measured_run,
)
from keel.plan.tuning import from_sweep, tuning_lines
from keel.rundir.progress import format_duration

TOP = 5  # layouts shown


@dataclass(frozen=True)
class Question:
    cfg: Config
    gpus: int
    hardware: str
    tokens: float
    price: float = DEFAULT_PRICE_PER_HOUR
    storage_gbs: float = 2000.0  # aggregate checkpoint write bandwidth, GB/s (Llama 3's 2 TB/s)
    mtbf_hours: float | None = None  # per accelerator (None: its generation's published runs)
    net_gbps: float | None = None  # inter-node GB/s per accelerator (None: the catalog's)
    fabric_devices: float | None = None  # accelerators one scale-up fabric joins (None: the catalog's)
    fragmentation: float = 0.05  # what the allocator reserves beyond the allocated peak, a share of it
    memory_coverage: float = DEFAULT_MEMORY_COVERAGE  # p_m: the share of failures the memory tier restores
    recovery: Recovery = Recovery(triage_s=TRIAGE_H * 3600)
    mix: FailureMix = PUBLISHED_MIX  # how failures show (keel.plan.failure_rates)
    silent_detect_s: float | None = None  # None: keel's guard latency at the planned step
    spares: int | None = None  # hot spare nodes; None: as many as pay for themselves
    layout: str = ""  # `--layout tp=8,pp=16,...`: predict this layout (else the config's [parallel], if set)
    calibrate_from: Path | None = None
    efficiency: Efficiency | None = None  # measured factors (a cluster file of `--measure`); --calibrate wins
    peak_tflops: float | None = None  # the accelerator's measured dense peak, where its catalog entry has none
    intra_gbps: float | None = None  # and its measured link bandwidth within a node
    memory_gbps: float | None = None  # and memory bandwidth
    kernel_figures: tuple[tuple[str, float], ...] = ()  # the cluster's own (keel.plan.kernels.with_figures)
    sweep: Path | None = None  # a keel sweep's directory: the learning rate, warmup and loss it predicts
    trials: int = 2000
    seed: int = 0


def hardware(q: Question) -> Accelerator:
    """The accelerator of the question, with the cluster's own network and fabric when given, its allocator's
    fragmentation, and what `--measure` measured of it."""
    hw = replace(by_key(q.hardware), fragmentation=q.fragmentation)
    if q.peak_tflops is not None:  # what keel measured on a CPU, in the precision it computes in there
        if hw.peak_flops:
            raise KeelError(f"--cluster peak_tflops = {q.peak_tflops:g}: {hw.name} has a published peak; the figure "
                            f"is for an accelerator without one (a CPU, as `keel plan --measure` writes it)")
        hw = replace(hw, peak_flops={"bf16": q.peak_tflops * 1e12, "fp32": q.peak_tflops * 1e12})
    if q.memory_gbps is not None:
        if hw.memory_bw:
            raise KeelError(f"--cluster memory_gbps = {q.memory_gbps:g}: {hw.name} has a published memory bandwidth; "
                            f"the figure is for an accelerator without one (a CPU, as `keel plan --calibrate-sweep` "
                            f"writes it); give memory_efficiency instead")
        hw = replace(hw, memory_bw=q.memory_gbps * 1e9)
    if q.intra_gbps is not None:
        hw = replace(hw, intra_bw=q.intra_gbps * 1e9)
    if q.fabric_devices is not None:
        hw = replace(hw, fabric_devices=int(q.fabric_devices))
    return hw if q.net_gbps is None else replace(hw, inter_bw=q.net_gbps * 1e9)


def basis(q: Question) -> tuple[Accelerator, Efficiency, Workload]:
    """What every prediction of `q` rests on: the accelerator, the efficiency factors and the workload."""
    hw = hardware(q)
    if q.gpus < 1 or q.tokens <= 0:
        raise KeelError(f"--gpus {q.gpus} --tokens {q.tokens:g}: both must be positive")
    eff = calibrate(q.calibrate_from, hw) if q.calibrate_from else \
        q.efficiency or efficiency_for(hw, kernels_measured=bool(q.kernel_figures))
    if q.kernel_figures:
        eff = replace(eff, kernels=with_figures(kernels_for(hw), dict(q.kernel_figures)))
    if q.calibrate_from and not hw.peak_flops:  # a CPU has no published peak: the run measured its own
        hw = measured_run(q.calibrate_from, hw).hw
    # keel computes in fp32 on a CPU unless told otherwise (train.precision = auto); every GPU plan is in bf16
    return hw, eff, Workload.of(q.cfg, q.tokens, q.cfg.train.compute_precision("cpu") if hw.key == "cpu" else "bf16")


def _kernels(work: Workload, hw: Accelerator, eff: Efficiency) -> dict:
    """The kernels the step model times: what the trainer runs (the config's) and how close the hardware's come to
    its peaks."""
    soft, kern = SOFTWARE[work.software], eff.kernels_on(hw)
    forward, backward = kern.attention_efficiency(soft.attention)
    return {"software": work.software, "attention": soft.attention, "fused": soft.fused, "gemm": kern.gemm,
            "attention_forward": forward, "attention_backward": backward, "source": kern.source}


def _kernels_line(k: dict) -> str:
    fused = "fused" if k["fused"] else "eager (parallel.compile = true fuses them)"
    given = " (the cluster file's figures)" if k["source"].startswith("the cluster file's") else ""
    return (f"kernels: {k['software']}: GEMMs at up to {k['gemm']:.0%} of the peak, {k['attention']} attention at "
            f"{k['attention_forward']:.0%}/{k['attention_backward']:.0%} forward/backward, element-wise {fused}{given}")


def answer(q: Question) -> dict:
    """Everything `keel plan` says, as one JSON-friendly dict."""
    hw, eff, work = basis(q)
    tuning = from_sweep(q.sweep, q.cfg, work.n_params, work.steps()) if q.sweep else None  # a bad one fails first
    given, unmodelled = (parse_layout(q.layout, q.gpus), []) if q.layout else config_layout(q.cfg, q.gpus)
    candidates = search(work, q.gpus, hw, eff)
    fitting = [c for c in candidates if c.fits]
    assessed = assess(work, given, hw, eff, candidates) if given is not None else None
    if not fitting and assessed is None:
        nearest = min(candidates, key=lambda c: c.memory.total)
        raise KeelError(f"no layout of {q.cfg.name} fits {q.gpus} × {hw.name}: "
                        f"{suggest(work, nearest.layout, hw)}")
    best = assessed.candidate if assessed is not None else fitting[0]  # the layout the run is planned on
    run = planned_run(q, hw, work.steps() * best.step.total, checkpoint_bytes(work.n_params, q.gpus),
                      best.step.total)
    spares, options = (q.spares, []) if q.spares is not None else \
        best_spares(run, Policy(), q.price, q.seed, q.trials)
    policies = compare_policies(run, seed=q.seed, trials=q.trials, base=Policy(
        name=f"async, optimal interval, disk restore, {spares} spare node(s)", spare_nodes=spares))
    chosen = policies[0]
    blocking, write = save_times(run, async_save=True)
    spent = cost_of(chosen, run, q.price)
    return {
        "question": {"config": q.cfg.name, "gpus": q.gpus, "hardware": hw.name, "tokens": q.tokens,
                     "price_per_hour": q.price, "storage_gb_s": q.storage_gbs,
                     "device_mtbf_hours": run.failures.device_mtbf_h,
                     "mtbf_source": "given" if q.mtbf_hours is not None else failures_source(hw.key),
                     "net_gb_s": hw.inter_bw / 1e9, "detect_s": q.recovery.detect_s,
                     "restart_s": q.recovery.restart_s, "repair_h": q.recovery.repair_s / 3600,
                     "failure_mix": asdict(q.mix), "hang_detect_s": run.recovery.hang_detect_s,
                     "silent_detect_s": run.recovery.silent_detect_s, "triage_h": run.recovery.triage_s / 3600,
                     "rollback_s": run.recovery.rollback_s,
                     "fragmentation": q.fragmentation, "seed": q.seed, "trials": q.trials},
        "spares": {"nodes": spares, "auto": q.spares is None, "options": options},
        "model": {"parameters": work.n_params, "active_parameters": work.n_active,
                  "flops_per_token": work.flops_per_token, "float8_flops_per_token": work.float8_flops_per_token,
                  "seq_len": work.seq_len,
                  "global_batch": work.global_batch, "steps": work.steps()},
        "experts": _experts(work, best.layout, best.step, hw, eff),
        "efficiency": asdict(eff),
        "kernels": _kernels(work, hw, eff),
        "memory_check": _memory_check(q.calibrate_from, hw) if q.calibrate_from else None,
        "layouts": [_candidate(c) for c in fitting[:TOP]],
        "given": None if assessed is None else {**assessed.row(), "not_modelled": unmodelled},
        "why": explain(candidates, work.experts) + [line for line in [untied_alternative(
            work, q.gpus, hw, eff, fitting[0] if fitting else None)] if line],
        "dropped": len(candidates) - len(fitting),
        "memory": {k: getattr(best.memory, k) / GIB for k in (*PARTS, "total", "reserved", "usable")},
        "step": best.step.parts() | {"total": best.step.total},
        "checkpoint": {"bytes": run.ckpt_bytes, "async_blocking_s": blocking, "write_s": write,
                       "job_mtbf_h": run.mtbf_s / 3600, "interval_s": young_daly(run, async_save=True)},
        "run": {"work_days": run.work_s / 86400, "wall_days": _days(chosen.stats("wall_s")),
                "goodput": chosen.stats("goodput"), "interruptions": chosen.stats("interruptions"),
                "expected_goodput": expected_goodput(run, chosen.policy)},
        "policies": [p.row() for p in policies],
        "tiers": _tiers(run, chosen, policies[-1], best.step.total),
        "cost": {"gpu_hours": spent.gpu_hours, "money": money_percentiles(chosen, run, q.price),
                 "parts": spent.parts()},
        "tuning": tuning,
    }


def _recovery_lines(q: dict, spares: dict) -> list[str]:
    """How failures are found and recovered from, and the spare nodes kept for them."""
    chosen = f"{spares['nodes']} hot spare node(s)" + (" (auto: " + ", ".join(
        f"{o['spares']} → {dollars(o['money'])}" for o in spares["options"]) + " mean cost)"
        if spares["auto"] else "")
    mix = q["failure_mix"]
    out = [f"recovery: detect {format_duration(q['detect_s'])} ({mix['hang']:.1%} hangs at "
           f"{format_duration(q['hang_detect_s'])}, {mix['silent']:.1%} silent corruption at "
           f"{format_duration(q['silent_detect_s'])}, {mix['manual']:.1%} triaged by hand in "
           f"{q['triage_h']:.1f} h), restart {format_duration(q['restart_s'])}, repair {q['repair_h']:g} h; "
           f"{chosen}; network {q['net_gb_s']:g} GB/s per GPU across nodes"]
    if mix["rollbacks_per_day"]:
        out.append(f"loss-spike rollbacks: {mix['rollbacks_per_day']:g} a day, each redoing "
                   f"{format_duration(q['rollback_s'])} of compute")
    return out


def planned_run(q: Question, hw: Accelerator, work_s: float, ckpt_bytes: float, step_s: float) -> Run:
    """The run the failure model replays: the accelerator's failure rate unless given, keel's own guards'
    latencies for silent corruption and loss spikes at the planned step time, and the memory tier's copies and
    restores over the cluster's scale-out network, at its bandwidth per accelerator."""
    silent_s, rollback_s = guard_latencies(q.cfg, step_s)
    recovery = replace(q.recovery, rollback_s=rollback_s,
                       silent_detect_s=silent_s if q.silent_detect_s is None else q.silent_detect_s)
    mtbf_h = device_mtbf_hours(hw.key) if q.mtbf_hours is None else q.mtbf_hours
    if hw.inter_bw <= 0:  # a CPU measured by one process: no peer to have measured a link with
        raise KeelError(f"--hardware {hw.key}: the network between its nodes is unknown (the failure model copies "
                        f"checkpoints to a peer over it); pass --net-gbps, or measure it on 2 or more processes "
                        f"(keel plan --calibrate-sweep)")
    return Run(work_s, q.gpus, ckpt_bytes,
               FailureModel(device_mtbf_h=mtbf_h, devices_per_node=hw.devices_per_node,
                            memory_coverage=q.memory_coverage, mix=q.mix),
               Storage(write_bw=q.storage_gbs * 1e9, peer_bw=hw.inter_bw), recovery)


def _tiers(run: Run, storage_only: SimResult, two: SimResult, step_s: float) -> dict:
    """The memory tier's forecast: storage-only checkpoints against memory + storage, each at its optimal
    intervals, on the same failures; intervals also in steps (`checkpoint.memory_interval`, `.interval`)."""
    def side(r: SimResult) -> dict:
        return {"interval_s": r.schedule.tau, "interval_steps": max(1, round(r.schedule.tau / step_s)),
                "goodput": r.stats("goodput"), "expected_goodput": expected_goodput(run, r.policy),
                "wall_days": _days(r.stats("wall_s")), "lost_per_failure_s": r.lost_per_failure_s,
                "restored_from_storage": r.row()["restored_from_storage"]}

    memory = two.tiers.memory if two.tiers else None
    return {"coverage": run.failures.memory_coverage, "storage_only": side(storage_only),
            "two_tier": side(two) | {
                "memory_interval_s": memory.tau if memory else None,
                "memory_interval_steps": max(1, round(memory.tau / step_s)) if memory else None,
                "memory_blocking_s": memory.blocking if memory else None},
            "goodput_gain": two.stats("goodput")["mean"] - storage_only.stats("goodput")["mean"],
            "wall_days_saved": (storage_only.stats("wall_s")["p50"] - two.stats("wall_s")["p50"]) / 86400,
            "replication": replication(run, two.tiers) if two.tiers else None}


def _tier_lines(t: dict) -> list[str]:
    one, two, copy = t["storage_only"], t["two_tier"], t["replication"]
    if two["memory_interval_s"] is None:
        return ["", f"checkpoint tiers: the memory tier restores {t['coverage']:.1%} of the failures: never worth "
                    f"a save, storage only"]
    return ["", f"checkpoint tiers: memory restores {t['coverage']:.1%} of the failures (all but a node lost with "
                f"its buddy, or the whole job); memory every {format_duration(two['memory_interval_s'])} "
                f"(~{two['memory_interval_steps']:,} steps) + storage every {format_duration(two['interval_s'])} "
                f"(~{two['interval_steps']:,} steps), against storage only every "
                f"{format_duration(one['interval_s'])} (~{one['interval_steps']:,} steps)",
            f"  goodput mean: storage only {one['goodput']['mean']:.2%} → memory + storage "
            f"{two['goodput']['mean']:.2%} ({100 * t['goodput_gain']:+.2f} points; analytic "
            f"{one['expected_goodput']:.2%} → {two['expected_goodput']:.2%}); wall P50 "
            f"{one['wall_days']['p50']:.1f} → {two['wall_days']['p50']:.1f} days; lost work per failure "
            f"{format_duration(one['lost_per_failure_s'])} → {format_duration(two['lost_per_failure_s'])}, "
            f"{two['restored_from_storage']:.1%} of restores from storage",
            f"  the copy to a buddy node: {copy['bytes_per_device'] / 1e9:.2f} GB per GPU per memory save over the "
            f"scale-out network, {copy['seconds']:.2g} s in the background ({copy['link_share']:.2%} of the link)"]


def _experts(work: Workload, layout: Layout, step: StepBreakdown, hw: Accelerator, eff: Efficiency) -> dict | None:
    """The planned layout's expert parallelism: its degree, and the all-to-all's bytes and time per step."""
    if not work.experts:
        return None
    link = ep_link(hw, layout, eff)
    return {"experts": work.experts, "top_k": work.model.moe.top_k, "ep": layout.ep,
            "experts_per_rank": work.experts // layout.ep, "expert_shard": layout.expert_shard(),
            "all_to_all_bytes_per_gpu": ep_exchange(work, layout), "all_to_all_s": step.ep_comm,
            "link": "intra-node" if link.nodes <= 1 else "inter-node", "link_gb_s": link.bandwidth / 1e9}


def _candidate(c: Candidate) -> dict:
    return {"layout": c.layout.describe(), "spec": c.layout.spec(), **asdict(c.layout),
            "memory_gib": c.memory.total / GIB, "headroom": c.memory.headroom, "step_s": c.step.total,
            "tokens_per_s_per_gpu": c.tokens_per_s, "mfu": c.step.mfu}


def _days(stats: dict[str, float]) -> dict[str, float]:
    return {k: v / 86400 for k, v in stats.items()}


def _memory_check(run_dir: Path, hw: Accelerator) -> dict:
    """The memory model against the calibration run's own measured peak."""
    try:
        check = check_run(run_dir, hw)
    except KeelError as e:
        return {"unavailable": str(e)}
    return {"run": Path(run_dir).name, "layout": check.predicted.layout.describe(),
            "measured_gib": check.measured / GIB, "predicted_gib": check.predicted.total / GIB, "error": check.error,
            "note": check.note}


def _memory_line(check: dict | None) -> list[str]:
    if not check:
        return []
    if "unavailable" in check:
        return [f"memory model: not checked ({check['unavailable']})"]
    return [f"memory model on {check['run']} ({check['layout']}): {check['predicted_gib']:.2f} GiB predicted, "
            f"{check['measured_gib']:.2f} measured above the runtime ({check['error']:+.0%})"
            + (f"; {check['note']}" if check["note"] else "")]


def lines(a: dict) -> list[str]:
    """The readable answer."""
    q, m, ck, run, cost = a["question"], a["model"], a["checkpoint"], a["run"], a["cost"]
    active = f" ({m['active_parameters'] / 1e9:.2f}B active)" if m["active_parameters"] != m["parameters"] else ""
    if m["float8_flops_per_token"]:
        active += f", {m['float8_flops_per_token'] / m['flops_per_token']:.0%} of its FLOPs in float8"
    width = max([40, *(len(c["layout"]) + 2 for c in a["layouts"])])  # the layout column
    out = [f"{q['config']}: {m['parameters'] / 1e9:.2f}B parameters{active}, {m['flops_per_token'] / 1e9:.0f} "
           f"GFLOP/token at sequence {m['seq_len']}; {q['tokens'] / 1e12:.2f}T tokens = {m['steps']:,} steps of "
           f"{m['global_batch']} × {m['seq_len']} on {q['gpus']:,} × {q['hardware']}",
           f"efficiency factors: compute {a['efficiency']['compute']:.2f}, overlap {a['efficiency']['overlap']:.2f}, "
           f"link {a['efficiency']['link']:.2f} ({a['efficiency']['source']})", _kernels_line(a["kernels"]),
           *_memory_line(a["memory_check"]), "",
           f"{'layout':<{width}}{'GiB/GPU':>9}{'headroom':>10}{'s/step':>9}{'tokens/s/GPU':>14}{'MFU':>7}"]
    for c in a["layouts"]:
        out.append(f"{c['layout']:<{width}}{c['memory_gib']:>9.1f}{c['headroom']:>10.0%}{c['step_s']:>9.3g}"
                   f"{c['tokens_per_s_per_gpu']:>14,.0f}{c['mfu']:>7.1%}")
    out += [f"({a['dropped']} layouts do not fit or do not divide the batch)", *a["why"], ""]
    out += _given_lines(a["given"])
    mem, planned = a["memory"], "given layout" if a["given"] else "best layout"
    out.append(f"memory per GPU, {planned} (GiB): " + ", ".join(
        f"{k} {mem[k]:.1f}" for k in PARTS)
        + f"; total {mem['total']:.1f}, {mem['reserved']:.1f} reserved with the allocator's "
        f"{q['fragmentation']:.0%} fragmentation, of {mem['usable']:.1f} usable")
    out.append(f"step time, {planned} (s): " + ", ".join(f"{k} {v:.3g}" for k, v in a["step"].items()))
    out += _experts_line(a["experts"], planned)
    out += ["", f"checkpoint {ck['bytes'] / 1e12:.2f} TB ({ck['bytes'] / q['gpus'] / 1e9:.2f} GB per GPU): an async "
            f"save blocks {ck['async_blocking_s']:.1f} s and writes in {ck['write_s']:.1f} s at "
            f"{q['storage_gb_s']:,.0f} GB/s; job MTBF {ck['job_mtbf_h']:.1f} h (per GPU "
            f"{q['device_mtbf_hours']:,.0f} h: {q['mtbf_source']}); Young/Daly interval "
            f"{format_duration(ck['interval_s'])}"]
    out += _recovery_lines(q, a["spares"])
    w, g, n = run["wall_days"], run["goodput"], run["interruptions"]
    out += [f"run ({q['trials']:,} Monte Carlo trials, seed {q['seed']}): {run['work_days']:.1f} days of compute; "
            f"wall time P10/P50/P90 {w['p10']:.1f} / {w['p50']:.1f} / {w['p90']:.1f} days; goodput "
            f"{g['p10']:.1%} / {g['p50']:.1%} / {g['p90']:.1%} (analytic {run['expected_goodput']:.1%}); "
            f"interruptions {n['p10']:.0f} / {n['p50']:.0f} / {n['p90']:.0f}", "",
            f"{'policy':<56}{'interval':>10}{'wall P50 (d)':>14}{'goodput P50':>13}"]
    for p in a["policies"]:
        out.append(f"{p['policy']:<56}{format_duration(p['interval_s']):>10}{p['wall_days']['p50']:>14.1f}"
                   f"{p['goodput']['p50']:>13.1%}")
    money, parts = cost["money"], cost["parts"]
    out += [*_tier_lines(a["tiers"]),
            "", f"cost at ${q['price_per_hour']:.2f}/GPU-hour: P10/P50/P90 ${money['p10'] / 1e6:,.2f}M / "
            f"${money['p50'] / 1e6:,.2f}M / ${money['p90'] / 1e6:,.2f}M; {cost['gpu_hours'] / 1e6:,.2f}M GPU-hours "
            f"(mean): " + ", ".join(f"{name} {parts[name]['share']:.1%}" for name in
                                    ("productive", "checkpointing", "failures.lost_work", "failures.down_time",
                                     "failures.spares"))]
    if a["tuning"]:
        out += ["", *tuning_lines(a["tuning"])]
    return out


def _given_lines(g: dict | None) -> list[str]:
    """The given layout: its prediction and rank, and what the planner says of it."""
    if g is None:
        return []
    ranked = f"ranks {g['rank']} of {g['of']} fitting layouts" if g["rank"] else \
        f"not ranked among the {g['of']} fitting layouts"
    out = [f"given layout {g['layout']}: {g['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU, MFU {g['mfu']:.1%}, "
           f"{g['step_s']:.3g} s/step, {g['memory_gib']:.1f} GiB; {ranked}: {g['versus_best']}; the breakdowns, "
           f"checkpoints, run and cost below are for it"]
    if not g["fits"]:
        out.append(f"  WARNING: it {g['memory_verdict']}")
    if g["not_modelled"]:
        out.append(f"  not modelled by the planner: {', '.join(g['not_modelled'])}")
    return [*out, ""]


def _experts_line(x: dict | None, planned: str) -> list[str]:
    if not x:
        return []
    if x["ep"] == 1:
        return [f"experts, {planned}: ep 1: every rank holds all {x['experts']} experts of a block (sharded over "
                f"dp_shard × cp); no all-to-all"]
    shard = f"sharded over {x['expert_shard']} ranks" if x["expert_shard"] > 1 else "not sharded further"
    return [f"experts, {planned}: ep {x['ep']}: {x['experts_per_rank']} of {x['experts']} experts per rank, "
            f"{shard}; all-to-all {x['all_to_all_bytes_per_gpu'] / 1e9:,.1f} GB sent per "
            f"GPU per step, {x['all_to_all_s']:.3g} s {x['link']} at {x['link_gb_s']:g} GB/s, not hidden behind "
            f"compute"]


def dollars(money: float) -> str:
    return f"${money / 1e6:,.2f}M" if money >= 1e6 else f"${money:,.0f}"


def to_json(a: dict) -> str:
    return json.dumps(a, indent=1, default=float)


def write_html(q: Question, a: dict, path: Path) -> Path:
    """Plots: wall time and cost against the GPU count, goodput against the checkpoint interval with the
    optimum marked, and the best layout's memory breakdown."""
    from keel.report.html import CSS
    from keel.report.svg import Marker, Series, bar_chart, line_chart

    counts, walls, costs = [], [], []
    for factor in (0.25, 0.5, 1, 2, 4):
        gpus = max(1, int(q.gpus * factor))
        try:
            other = a if gpus == q.gpus else answer(replace(q, gpus=gpus, trials=min(q.trials, 500)))
        except KeelError:
            continue  # nothing fits this many GPUs
        counts.append(gpus)
        walls.append(other["run"]["wall_days"]["p50"])
        costs.append(other["cost"]["money"]["p50"] / 1e6)
    hw, eff, work = basis(q)
    best = search(work, q.gpus, hw, eff)[0]
    run = planned_run(q, hw, work.steps() * best.step.total, a["checkpoint"]["bytes"], best.step.total)
    optimum = a["checkpoint"]["interval_s"]
    intervals = [optimum * 2 ** (k / 4) for k in range(-12, 13)]
    goodputs = [100 * expected_goodput(run, Policy(interval_s=t)) for t in intervals]
    mem = a["memory"]
    bars = [(k, mem[k], "#2563eb", f"{mem[k]:.1f} GiB") for k in PARTS]
    panels = [
        ("Wall time (P50 days) against GPUs", line_chart([Series("wall days", counts, walls, "#2563eb", dots=True)])),
        ("Cost (P50, $M) against GPUs", line_chart([Series("cost", counts, costs, "#dc2626", dots=True)])),
        ("Expected goodput (%) against the checkpoint interval (s); the marker is the Young/Daly optimum",
         line_chart([Series("goodput", intervals, goodputs, "#16a34a")], seconds=True, lanes=["optimum"],
                    markers=[Marker(optimum, 0, "#16a34a", f"optimum {format_duration(optimum)}")])),
        (f"Memory per GPU of {a['layouts'][0]['layout']} (GiB; {mem['usable']:.1f} usable)", bar_chart(bars)),
    ]
    body = "".join(f"<section class='panel'><h3>{escape(title)}</h3>{svg}</section>" for title, svg in panels)
    text = escape("\n".join(lines(a)))
    path.write_text(f"<!doctype html><html><head><meta charset='utf-8'><title>keel plan: {escape(q.cfg.name)}"
                    f"</title><style>{CSS}</style></head><body><main><h1>keel plan: {escape(q.cfg.name)}</h1>"
                    f"<pre style='font-size:12px;white-space:pre-wrap'>{text}</pre>{body}</main></body></html>\n")
    return path

