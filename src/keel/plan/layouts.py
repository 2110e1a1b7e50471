"""Layout search: every way keel can lay a workload out over a GPU count, what each costs in memory and
time, and why the best one wins.

Enumerated: tp over the divisors of a node's device count that divide the heads, KV heads and sequence
(keel's TP constraints); pp over the divisors of the layer count up to MAX_PP (no pipeline with tied
embeddings); v = 2 chunks per rank (interleaved 1F1B) where the layers divide into 2·pp stages; every
split of the remaining data parallelism into dp_shard × dp_replicate (HSDP); micro-batches of 1, 2, 4 …
sequences dividing the per-rank batch (and, with a pipeline, leaving at least pp of them); activation
checkpointing none, selective, full. Layouts that do not divide the batch are not layouts; those that do
not fit stay in the list with their memory verdict, after the ones that do, which are ranked by
predicted tokens/s per device.
"""

from __future__ import annotations

from dataclasses import dataclass

from keel.core.accelerators import Accelerator
from keel.errors import KeelError
from keel.plan.layout import Layout, Workload
from keel.plan.memory import GIB, MemoryBreakdown, memory
from keel.plan.throughput import DEFAULT, Efficiency, StepBreakdown, step_time

MAX_PP = 16  # deeper pipelines need thousands of micro-batches to keep the bubble small
ACS = ("none", "selective", "full")
PART_NAMES = {"compute": "compute", "tp_comm": "TP collectives", "pp_p2p": "pipeline transfers",
              "bubble": "pipeline bubble", "fsdp_dp_exposed": "exposed FSDP/DP traffic"}


@dataclass(frozen=True)
class Candidate:
    layout: Layout
    memory: MemoryBreakdown
    step: StepBreakdown
    why: str  # feasible: the step and memory in one line; dropped: the memory verdict

    @property
    def fits(self) -> bool:
        return self.memory.fits

    @property
    def tokens_per_s(self) -> float:
        """Predicted tokens/s per device."""
        return self.step.tokens_per_s_per_device


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _powers_of_two_dividing(n: int) -> list[int]:
    out, d = [], 1
    while d <= n and n % d == 0:
        out.append(d)
        d *= 2
    return out


def layouts(work: Workload, gpus: int, hw: Accelerator) -> list[Layout]:
    """Every layout of `work` on `gpus` devices that keel can run and that divides the batch."""
    m = work.model
    per_node = max(1, int(hw.devices_per_node))
    tps = [t for t in _divisors(per_node) if gpus % t == 0 and not (m.n_heads % t or m.n_kv_heads % t
                                                                    or work.seq_len % t)]
    pps = [1] if m.tie_embeddings else [p for p in _divisors(m.n_layers) if p <= MAX_PP]
    out: list[Layout] = []
    for tp in tps:
        for pp in pps:
            if gpus % (tp * pp):
                continue
            dp = gpus // (tp * pp)
            if work.global_batch % dp:
                continue
            per_rank = work.global_batch // dp
            vs = [1] + ([2] if pp > 1 and m.n_layers % (2 * pp) == 0 else [])
            for replicate in _divisors(dp):
                for mb in _powers_of_two_dividing(per_rank):
                    if pp > 1 and per_rank // mb < pp:
                        continue
                    for v in vs:
                        out.extend(Layout(tp=tp, pp=pp, v=v, dp_shard=dp // replicate, dp_replicate=replicate,
                                          micro_batch=mb, ac=ac) for ac in ACS)
    return out


def _sort_key(c: Candidate) -> tuple:
    # Faster first; on a tie the simpler layout (fewer model-parallel ranks), then the roomier one.
    return (-round(c.tokens_per_s, 6), c.layout.tp * c.layout.pp * c.layout.v, -c.memory.headroom)


def search(work: Workload, gpus: int, hw: Accelerator, eff: Efficiency = DEFAULT) -> list[Candidate]:
    """All layouts of `work` on `gpus` devices of `hw`: those that fit, fastest first, then those that do
    not (smallest first), each with its memory and predicted step."""
    if gpus < 1:
        raise KeelError(f"gpus = {gpus}: expected at least 1")
    found = layouts(work, gpus, hw)
    if not found:
        raise KeelError(f"no layout of {gpus} devices divides the global batch of {work.global_batch} sequences: "
                        f"data parallelism (gpus / (tp × pp), tp ≤ {hw.devices_per_node}, pp ≤ {MAX_PP}) must "
                        f"divide it; change the batch or the device count")
    fitting, dropped = [], []
    for layout in found:
        mem = memory(work, layout, hw)
        step = step_time(work, layout, hw, eff)
        if mem.fits:
            fitting.append(Candidate(layout, mem, step, f"{step.explain()}; {mem.total / GIB:.1f} GiB"))
        else:
            dropped.append(Candidate(layout, mem, step, mem.explain()))
    fitting.sort(key=_sort_key)
    dropped.sort(key=lambda c: c.memory.total)
    return fitting + dropped


def _best(candidates: list[Candidate], keep) -> Candidate | None:
    """The first (best-ranked) candidate that `keep` accepts: fitting ones rank before dropped ones."""
    return next((c for c in candidates if keep(c.layout)), None)


def _versus(best: Candidate, alt: Candidate) -> str:
    """How `alt` compares with the best: its speed and the parts of its step that grew most."""
    if not alt.fits:
        return f"does not fit: {alt.memory.explain()}"
    loss = alt.tokens_per_s / best.tokens_per_s - 1
    grown = {name: alt.step.parts()[name] - value for name, value in best.step.parts().items()}
    reasons = [f"{PART_NAMES[name]} +{delta:.2f} s" for name, delta in sorted(grown.items(), key=lambda kv: -kv[1])
               if delta > 0.005 * best.step.total][:2]
    tail = f" ({', '.join(reasons)} per step)" if reasons else ""
    return f"{alt.tokens_per_s:,.0f} tokens/s/device ({loss:+.0%}){tail}"


def explain(candidates: list[Candidate]) -> list[str]:
    """Why the best layout wins and how the obvious alternatives (FSDP only, more TP, pipeline or not)
    compare, with their numbers."""
    if not candidates:
        return ["no layout to explain"]
    fitting = [c for c in candidates if c.fits]
    if not fitting:
        closest = candidates[0]
        return [f"no layout fits: the smallest needs {closest.memory.total / GIB:.1f} GiB per device "
                f"({closest.memory.explain()}); use more devices or a device with more memory"]
    best = fitting[0]
    s, mem = best.step, best.memory
    lines = [f"best: {best.layout.describe()}: {best.tokens_per_s:,.0f} tokens/s/device, MFU {s.mfu:.1%}, "
             f"{s.total:.3g} s/step; {mem.total / GIB:.1f} of {mem.usable / GIB:.1f} GiB usable"]
    parts = ", ".join(f"{PART_NAMES[name]} {value / s.total:.0%}" for name, value in
                      sorted(s.parts().items(), key=lambda kv: -kv[1]) if value > 0.005 * s.total)
    lines.append(f"  its step: {parts}")
    lay = best.layout
    alternatives = [
        ("FSDP only", lambda x: x.tp == 1 and x.pp == 1 and x.dp_replicate == 1),
        (f"more TP (tp={lay.tp * 2})", lambda x: x.tp == lay.tp * 2),
        (f"less TP (tp={lay.tp // 2})", lambda x: lay.tp > 1 and x.tp == lay.tp // 2),
        ("with a pipeline" if lay.pp == 1 else "without a pipeline", lambda x: (x.pp > 1) != (lay.pp > 1)),
        ("no activation checkpointing" if lay.ac != "none" else "activation checkpointing",
         lambda x: (x.ac == "none") != (lay.ac == "none")),
    ]
    if lay.dp() > 1:
        alternatives.append(("HSDP (replicas across nodes)" if lay.dp_replicate == 1 else "FSDP across all replicas",
                             lambda x: (x.dp_replicate > 1) != (lay.dp_replicate > 1) and x.tp == lay.tp
                             and x.pp == lay.pp))
    seen = {lay}
    for name, keep in alternatives:
        alt = _best(candidates, keep)
        if alt is None and name in ("FSDP only", f"more TP (tp={lay.tp * 2})"):
            lines.append(f"  {name}: no such layout: "
                         + (f"{lay.gpus()}-way data parallelism does not divide the batch" if name == "FSDP only"
                            else "TP stays within a node and must divide the heads, KV heads and sequence"))
        if alt is None or alt.layout in seen:
            continue
        seen.add(alt.layout)
        lines.append(f"  {name}: best is {alt.layout.describe()}: {_versus(best, alt)}")
    dropped = len(candidates) - len(fitting)
    if dropped:
        lines.append(f"  {dropped} of {len(candidates)} layouts do not fit in {mem.usable / GIB:.1f} GiB usable")
    return lines
