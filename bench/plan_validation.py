"""The throughput planner against published pre-training runs: every run of bench/published_runs.toml (papers,
vendor performance tables and repositories; dense and mixture-of-experts, bf16 and FP8, GPUs and TPUs) is
predicted with its layout as published, the kernels its trainer runs (the source's `software`) and the planner's
default efficiency for the accelerator's generation (`keel.plan.throughput.efficiency_for`), in the quantity the
source published (tokens/s per device, MFU, HFU or TFLOP/s per device, each counted as that source counts it: see
the file's header). Error = predicted / published − 1.

A generation's efficiency is the one figure fitted to the table (`fit`: the median run of the generation predicted
exactly), so each run is also predicted with it fitted to the other runs of its generation alone ("left out";
a generation of one run then gets the default of hardware without published runs).

Each run's published layout is also looked for in the planner's own search (`keel.plan.layouts.search` on the
same devices): the first searched candidate with the same tp, pp, v, cp, ep and data-parallel degree (and
micro-batch and activation checkpointing, unless the source did not give them) gives its rank among the layouts
that fit; "not searched" when the search does not enumerate it (context parallelism at short sequences, tensor
parallelism with experts ...), "does not fit" when the planner's memory model drops it. It is ranked twice: among
every layout keel can run, and among those the run's own trainer offered (`Offers`, the source's `offers`: a
trainer without FSDP shards nothing, or only its optimizer state, and some have no pipeline or no selective
checkpointing), which is the choice its team had.

Summary: median and largest |error|, runs within 10% and 25%, the share whose published layout ranks in the top
3 (of keel's layouts and of its trainer's); by source and by accelerator generation. Nothing runs on an
accelerator: the planner imports no torch, so the whole set takes a few minutes on one core (the searches; the
predictions alone take well under a second).

    python -m bench.plan_validation      writes bench/results/plan_validation.json
    python -m bench.tables               then renders its table into docs/planning.md
"""

from __future__ import annotations

import argparse
import json
import statistics
import tomllib
from dataclasses import dataclass, replace
from pathlib import Path

from keel.config import ModelConfig, load_config
from keel.core.accelerators import GIB, Accelerator, by_key
from keel.errors import KeelError
from keel.plan.layout import ACS, CP_MIN_SEQ, Layout, Workload
from keel.plan.layouts import MAX_PP, interleavings, search
from keel.plan.memory import memory
from keel.plan.throughput import DEFAULT, RECOMPUTE, Efficiency, StepBreakdown, efficiency_for, peak_flops, step_time

REPO = Path(__file__).resolve().parent.parent
RUNS = REPO / "bench" / "published_runs.toml"
RESULTS = REPO / "bench" / "results" / "plan_validation.json"
QUANTITIES = {"tokens_per_s": "tokens/s/device", "mfu": "MFU", "hfu": "HFU", "model_tflops": "model TFLOP/s/device",
              "hardware_tflops": "hardware TFLOP/s/device"}
# Compared with the search's candidates: the degrees always, these two only where the source gives them.
OPTIONAL = ("micro_batch", "ac")
HW_FIELDS = {"bf16_tflops": None, "fp8_tflops": None, "memory_gib": "memory_bytes", "memory_bw": "memory_bw",
             "intra_bw": "intra_bw", "inter_bw": "inter_bw", "devices_per_node": "devices_per_node",
             "fabric_devices": "fabric_devices"}


@dataclass(frozen=True)
class Offers:
    """The layouts a run's trainer offered: the ZeRO stages its data parallelism shards with (3: FSDP; 1 and 2: a
    distributed optimizer; none: whole replicas only), its activation checkpointing, and whether it has tensor,
    pipeline, context and expert parallelism."""

    sharding: tuple[int, ...] = (3,)
    ac: tuple[str, ...] = ACS
    tp: bool = True
    pp: bool = True
    cp: bool = True
    ep: bool = True

    def variants(self, layout: Layout) -> list[Layout]:
        """What the trainer runs in place of keel's `layout`: nothing where it lacks one of its parts, else the
        layout with each of the trainer's ways to shard the data-parallel state."""
        parts = ((layout.tp, self.tp), (layout.pp, self.pp), (layout.cp, self.cp), (layout.ep, self.ep))
        if layout.ac not in self.ac or any(degree > 1 and not offered for degree, offered in parts):
            return []
        if layout.shard() == 1:
            return [layout]
        return [replace(layout, zero=zero) for zero in self.sharding]


def offers(spec: dict) -> Offers:
    return Offers(**{k: tuple(v) if isinstance(v, list) else v for k, v in spec.items()})


@dataclass(frozen=True)
class Run:
    name: str
    source: str
    where: str
    work: Workload
    layout: Layout
    hw: Accelerator
    devices: int
    quantity: str
    published: float
    published_memory_gib: float | None = None
    assumed: tuple[str, ...] = ()
    notes: str = ""
    offers: Offers = Offers()


def load(path: Path = RUNS) -> dict:
    return tomllib.loads(path.read_text())


def hardware(spec: dict) -> Accelerator:
    """A catalog accelerator with the run's machines' figures in place of the catalog's where they differ."""
    base = by_key(spec["base"])
    changes: dict = {name: spec[key] * (GIB if key == "memory_gib" else 1)
                     for key, name in HW_FIELDS.items() if name and key in spec}
    peaks = dict(base.peak_flops)
    for dtype in ("bf16", "fp8"):
        if f"{dtype}_tflops" in spec:
            peaks[dtype] = spec[f"{dtype}_tflops"] * 1e12
    peaks["fp16"] = peaks["bf16"]
    return replace(base, peak_flops=peaks, **changes)


def model(spec: dict) -> ModelConfig:
    if "config" in spec:
        return load_config(REPO / "configs" / f"{spec['config']}.toml", []).model
    return ModelConfig(**spec)


def runs(data: dict | None = None) -> list[Run]:
    """The runs of bench/published_runs.toml, each with its workload, layout and accelerator."""
    data = data or load()
    machines = {key: hardware(spec) for key, spec in data["hardware"].items()}
    models = {key: model(spec) for key, spec in data["models"].items()}
    out = []
    for r in data["runs"]:
        hw = machines[r["hardware"]] if r["hardware"] in machines else by_key(r["hardware"])
        software = r.get("software", data["sources"][r["source"]]["software"])
        work = Workload(models[r["model"]], r["seq"], r["global_batch"], fp8=r["precision"] == "fp8", software=software)
        offered = offers({**data["sources"][r["source"]].get("offers", {}), **r.get("offers", {})})
        out.append(Run(r["name"], r["source"], r["where"], work, Layout(**r["layout"]), hw, r["devices"],
                       r["quantity"], float(r["published"]), r.get("published_memory_gib"),
                       tuple(r.get("assumed", ())), r.get("notes", ""), offered))
    return out


def quantity(run: Run, step: StepBreakdown) -> float:
    """The planner's step in the run's published quantity. Hardware FLOPs add the recomputed forwards of the
    blocks (a third of their training FLOPs per recomputed forward; the output projection is not recomputed)."""
    work = run.work
    model_flops = work.flops_per_token
    recomputed = RECOMPUTE[run.layout.ac] / 3 * (model_flops - work.head_flops_per_token)
    flops = model_flops + recomputed if run.quantity in ("hfu", "hardware_tflops") else model_flops
    per_s = step.tokens_per_s_per_device * flops
    if run.quantity == "tokens_per_s":
        return step.tokens_per_s_per_device
    if run.quantity in ("mfu", "hfu"):
        return per_s / peak_flops(work, run.hw)
    return per_s / 1e12


def predict(run: Run, eff: Efficiency | None = None) -> float:
    """The run's published quantity as the planner predicts it, with its default efficiency factors (or `eff`)."""
    return quantity(run, step_time(run.work, run.layout, run.hw, eff or efficiency_for(run.hw)))


def fit(published: list[Run] | None = None, rounds: int = 4) -> dict[str, float]:
    """Each generation's compute efficiency (`keel.plan.throughput.GENERATIONS`): the factor that makes the median
    of its runs' predicted / published 1. The step is not quite proportional to it (communication, bubbles), so a
    few rounds of rescaling settle it."""
    published = published or runs()
    fitted = {run.hw.generation: efficiency_for(run.hw).compute for run in published}
    for _ in range(rounds):
        by_generation: dict[str, list[float]] = {}
        for run in published:
            eff = replace(efficiency_for(run.hw), compute=fitted[run.hw.generation])
            by_generation.setdefault(run.hw.generation, []).append(predict(run, eff) / run.published)
        fitted = {g: fitted[g] / statistics.median(ratios) for g, ratios in by_generation.items()}
    return fitted


def left_out(run: Run, ratios: list[float]) -> float:
    """The run predicted with its generation's efficiency fitted to the other runs of that generation (their
    ratios, predicted / published, at the planner's own efficiency); with none left, the default efficiency of a
    generation without published runs."""
    if not ratios:
        return predict(run, DEFAULT)
    eff = efficiency_for(run.hw)
    return predict(run, replace(eff, compute=eff.compute / statistics.median(ratios)))


def matches(run: Run, candidate: Layout) -> bool:
    """Whether a searched layout is the published one: the same degrees (the data-parallel one whole: the planner
    searches FSDP, HSDP and DDP splits alike), and micro-batch and checkpointing where the source gives them."""
    mine = run.layout
    keys = ("tp", "pp", "v", "cp", "ep", *(k for k in OPTIONAL if k not in run.assumed))
    return all(getattr(mine, k) == getattr(candidate, k) for k in keys) and mine.dp() == candidate.dp()


def rank(run: Run, trainers: bool = False) -> str | int:
    """The published layout's rank among the searched layouts that fit (with `trainers`: those its trainer
    offered), or why it has none."""
    try:
        candidates = search(run.work, run.devices, run.hw, efficiency_for(run.hw),
                            run.offers.variants if trainers else None)
    except KeelError:  # no searched layout divides the batch
        return f"not searched ({unsearched(run)})"
    fitting = sum(c.fits for c in candidates)
    found = next((i for i, c in enumerate(candidates) if matches(run, c.layout)), None)
    if found is None:
        return f"not searched ({unsearched(run)})"
    return found + 1 if found < fitting else "does not fit"


def unsearched(run: Run) -> str:
    """Why the search does not enumerate the published layout (keel.plan.layouts.layouts)."""
    lay, work = run.layout, run.work
    reasons = [(lay.v not in interleavings(work.model.n_layers, lay.pp), f"v {lay.v}"),
               (lay.cp > 1 and work.seq_len < CP_MIN_SEQ, "cp at a short sequence"),
               (lay.tp > 1 and work.experts > 0, "tp with experts"),
               (work.model.n_kv_heads % lay.tp != 0, f"tp {lay.tp} over {work.model.n_kv_heads} KV heads"),
               (lay.pp > 1 and work.model.tie_embeddings, "pp with tied embeddings"),
               (lay.pp > MAX_PP, f"pp above {MAX_PP}")]
    return ", ".join(why for hit, why in reasons if hit) or "not enumerated"


def evaluate(run: Run, others: list[float], with_rank: bool = True) -> dict:
    predicted = predict(run)
    alone = left_out(run, others)
    row = {"name": run.name, "source": run.source, "where": run.where, "hardware": run.hw.key,
           "generation": run.hw.generation, "devices": run.devices,
           "layout": run.layout.describe(), "precision": "fp8" if run.work.fp8 else "bf16",
           "quantity": run.quantity, "published": run.published, "predicted": predicted,
           "error": predicted / run.published - 1, "left_out": alone, "left_out_error": alone / run.published - 1,
           "assumed": list(run.assumed),
           "predicted_memory_gib": memory(run.work, run.layout, run.hw).total / GIB,
           "published_memory_gib": run.published_memory_gib}
    if with_rank:
        row["rank"], row["trainer_rank"] = rank(run), rank(run, trainers=True)
    return row


def summary(rows: list[dict]) -> dict:
    errors = [abs(r["error"]) for r in rows]
    ranked = [r for r in rows if "rank" in r]
    return {"runs": len(rows), "median_abs_error": statistics.median(errors), "max_abs_error": max(errors),
            "within_10": sum(e <= 0.10 for e in errors), "within_25": sum(e <= 0.25 for e in errors),
            "top3": sum(isinstance(r["rank"], int) and r["rank"] <= 3 for r in ranked),
            "top3_trainer": sum(isinstance(r["trainer_rank"], int) and r["trainer_rank"] <= 3 for r in ranked),
            "not_searched": sum(str(r["rank"]).startswith("not searched") for r in ranked),
            "does_not_fit": sum(r["rank"] == "does not fit" for r in ranked)}


def grouped(rows: list[dict], key: str) -> dict[str, dict]:
    return {name: summary([r for r in rows if r[key] == name]) for name in dict.fromkeys(r[key] for r in rows)}


def validate(with_rank: bool = True) -> dict:
    published = runs()
    ratios = [predict(run) / run.published for run in published]
    rows = [evaluate(run, [ratio for other, ratio in zip(published, ratios, strict=True)  # its generation's others
                           if other is not run and other.hw.generation == run.hw.generation], with_rank)
            for run in published]
    held_out = [{**r, "error": r["left_out_error"]} for r in rows]
    return {"rows": rows, "summary": summary(rows), "held_out": summary(held_out),
            "by_source": grouped(rows, "source"), "by_generation": grouped(rows, "generation")}


def _figure(value: float, quantity: str) -> str:
    if quantity in ("mfu", "hfu"):
        return f"{value:.1%} {QUANTITIES[quantity]}"
    return f"{value:,.0f} {QUANTITIES[quantity]}"


def _line(name: str, s: dict) -> str:
    count = f"{s['runs']} run{'s' if s['runs'] > 1 else ''}"
    return (f"{name}: {count}, median |error| {s['median_abs_error']:.1%}, largest {s['max_abs_error']:.1%}, "
            f"{s['within_10']} within 10%, {s['within_25']} within 25%, published layout in the top 3 for "
            f"{s['top3']} ({s['top3'] / s['runs']:.0%}; {s['not_searched']} not searched, "
            f"{s['does_not_fit']} dropped for memory), among its trainer's layouts for {s['top3_trainer']} "
            f"({s['top3_trainer'] / s['runs']:.0%})")


def markdown(results: dict) -> str:
    rows = ["| run | source | layout | published | predicted | error | left out | rank of the published layout: "
            "of keel's | of its trainer's |", "|---|---|---|---:|---:|---:|---:|---|---|"]
    for r in results["rows"]:
        name = r["name"]
        value = r["predicted"]
        predicted = f"{value:.1%}" if r["quantity"] in ("mfu", "hfu") else f"{value:,.0f}"
        rows.append(f"| {name} | {r['source']} | {r['layout']} | {_figure(r['published'], r['quantity'])} | "
                    f"{predicted} | {r['error']:+.1%} | {r['left_out_error']:+.1%} | {r['rank']} | "
                    f"{r['trainer_rank']} |")
    lines = [_line("All", results["summary"]), _line("Each left out of its generation's fit", results["held_out"])]
    lines += [_line(f"Source {name}", s) for name, s in results["by_source"].items()]
    lines += [_line(f"Generation {name}", s) for name, s in results["by_generation"].items()]
    return "\n".join([*rows, "", *(f"- {line}" for line in lines)])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    results = validate()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(markdown(results))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
