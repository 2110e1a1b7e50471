"""Layout search: every way keel can lay a workload out over a GPU count, what each costs in memory and
time, and why the best one wins.

Enumerated: tp over the divisors of a node's device count that divide the heads, KV heads and sequence
(keel's TP constraints); cp (context parallelism) over the divisors of the device count that split the
sequence into 2·cp equal chunks, each rank's share still divisible by tp, when the sequence is long
(CP_MIN_SEQ) or when no layout without it fits; pp from 1 to the block count, at most MAX_PP (stages
split as keel.model.split does, uneven where they must be; no pipeline with tied embeddings); v chunks per rank
(interleaved 1F1B): 2 or 4 where there are at least v·pp blocks, and every v that gives each stage the same
whole number of blocks; every
split of the remaining data parallelism into dp_shard × dp_replicate (HSDP); for a mixture-of-experts model
ep over the divisors of dp_shard × cp that divide the experts (and tp = 1: keel replicates expert blocks over
tensor-parallel ranks, which the planner does not model); micro-batches of every size dividing the per-rank
batch (and, with a pipeline, leaving at least pp of them); activation
checkpointing none, selective, full. Layouts that do not divide the batch are not layouts; those that do
not fit stay in the list with their memory verdict, after the ones that do, which are ranked by
predicted tokens/s per device.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from keel.core.accelerators import Accelerator
from keel.errors import KeelError
from keel.plan.layout import ACS, CP_MIN_SEQ, Layout, Workload
from keel.plan.memory import GIB, MemoryBreakdown, cp_fits_sequence, memory, suggest
from keel.plan.throughput import DEFAULT, Efficiency, StepBreakdown, step_time

# What another trainer runs in place of one of keel's layouts: nothing, or its own forms of it.
Variants = Callable[[Layout], list[Layout]]
MAX_PP = 64  # deeper pipelines need thousands of micro-batches to keep the bubble small
PART_NAMES = {"compute": "compute", "tp_comm": "TP collectives", "cp_comm": "CP K/V exchange",
              "ep_comm": "EP all-to-all", "pp_p2p": "pipeline transfers", "bubble": "pipeline bubble",
              "fsdp_dp_exposed": "exposed FSDP/DP traffic"}


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


def interleavings(blocks: int, pp: int) -> list[int]:
    """Model chunks per pipeline rank: 1, and with a pipeline 2 and 4 (keel.model.split evens out the blocks) and
    every v that gives each of the pp × v stages the same whole number of blocks (as Megatron-LM requires)."""
    if pp == 1:
        return [1]
    return sorted({1, *(v for v in (2, 4) if blocks >= v * pp), *(v for v in _divisors(blocks // pp)
                                                                    if blocks % (pp * v) == 0)})


def context_degrees(work: Workload, gpus: int) -> list[int]:
    """The CP degrees above 1 that divide `gpus` and split the sequence into 2·cp equal chunks."""
    return [d for d in _divisors(gpus) if d > 1 and work.seq_len % (2 * d) == 0]


def layouts(work: Workload, gpus: int, hw: Accelerator, cps: list[int] | None = None) -> list[Layout]:
    """Every layout of `work` on `gpus` devices that keel can run and that divides the batch, with each of the
    CP degrees `cps` (default: none, cp = 1)."""
    m = work.model
    tps = [t for t in _divisors(hw.fabric()) if gpus % t == 0 and not (m.n_heads % t or m.n_kv_heads % t
                                                                    or work.seq_len % t)]
    tps = [1] if work.experts else tps
    # Any number of stages up to the blocks (keel.model.split balances them); no pipeline with tied embeddings.
    pps = [1] if m.tie_embeddings else [p for p in range(1, min(m.n_layers, MAX_PP) + 1)]
    out: list[Layout] = []
    for tp, cp, pp in ((tp, cp, pp) for tp in tps for cp in cps or [1] for pp in pps):
        if gpus % (tp * pp * cp) or not cp_fits_sequence(work, tp, cp):
            continue
        dp = gpus // (tp * pp * cp)  # the batch is split over dp only: a CP group shares its sequences
        if work.global_batch % dp:
            continue
        per_rank = work.global_batch // dp
        vs = interleavings(m.n_layers, pp)
        for replicate in _divisors(dp):
            eps = [d for d in _divisors(dp // replicate * cp) if work.experts % d == 0] if work.experts else [1]
            for mb in _divisors(per_rank):
                if pp > 1 and per_rank // mb < pp:
                    continue
                out.extend(Layout(tp=tp, pp=pp, v=v, dp_shard=dp // replicate, dp_replicate=replicate, cp=cp, ep=ep,
                                  micro_batch=mb, ac=ac) for v in vs for ep in eps for ac in ACS)
    return out


def _sort_key(c: Candidate) -> tuple:
    # Faster first; on a tie the simpler layout (fewer model-parallel ranks), then the roomier one.
    lay = c.layout
    return (-round(c.tokens_per_s, 6), lay.tp * lay.pp * lay.v * lay.cp * lay.ep, -c.memory.headroom)


def _assessed(work: Workload, found: list[Layout], hw: Accelerator, eff: Efficiency) -> list[Candidate]:
    out = []
    for layout in found:
        mem = memory(work, layout, hw)
        step = step_time(work, layout, hw, eff)
        out.append(Candidate(layout, mem, step, f"{step.explain()}; {mem.total / GIB:.1f} GiB" if mem.fits
                             else mem.explain()))
    return out


def search(work: Workload, gpus: int, hw: Accelerator, eff: Efficiency = DEFAULT,
           variants: Variants | None = None) -> list[Candidate]:
    """All layouts of `work` on `gpus` devices of `hw`: those that fit, fastest first, then those that do
    not (smallest first), each with its memory and predicted step. Context parallelism is searched from
    CP_MIN_SEQ on, and at shorter sequences when no layout without it fits. `variants`: what another trainer
    runs in place of each of keel's layouts (none, or its own forms of it); the search is then of those."""
    if gpus < 1:
        raise KeelError(f"gpus = {gpus}: expected at least 1")
    long = work.seq_len >= CP_MIN_SEQ

    def runnable(cps: list[int]) -> list[Layout]:
        found = layouts(work, gpus, hw, cps)
        return found if variants is None else [mine for layout in found for mine in variants(layout)]

    found = runnable([1, *context_degrees(work, gpus)] if long else [1])
    if not found:
        split = "tp × pp × cp" if long else "tp × pp"
        raise KeelError(f"no layout of {gpus} devices divides the global batch of {work.global_batch} sequences: "
                        f"data parallelism (gpus / ({split}), tp ≤ {hw.fabric()}, pp ≤ {MAX_PP}) must "
                        f"divide it; change the batch or the device count")
    candidates = _assessed(work, found, hw, eff)
    if not long and not any(c.fits for c in candidates):
        candidates += _assessed(work, runnable(context_degrees(work, gpus)), hw, eff)
    fitting = sorted((c for c in candidates if c.fits), key=_sort_key)
    dropped = sorted((c for c in candidates if not c.fits), key=lambda c: c.memory.total)
    return fitting + dropped


def _best(candidates: list[Candidate], keep) -> Candidate | None:
    """The first (best-ranked) candidate that `keep` accepts: fitting ones rank before dropped ones."""
    return next((c for c in candidates if keep(c.layout)), None)


def _versus(best: Candidate, alt: Candidate) -> str:
    """How `alt` compares with the best: its speed and the parts of its step that grew most."""
    if not alt.fits:
        return f"does not fit: {alt.memory.explain()}"
    return _speed_versus(best, alt)


def _speed_versus(best: Candidate, alt: Candidate) -> str:
    loss = alt.tokens_per_s / best.tokens_per_s - 1
    grown = {name: alt.step.parts()[name] - value for name, value in best.step.parts().items()}
    reasons = [f"{PART_NAMES[name]} +{delta:.2f} s" for name, delta in sorted(grown.items(), key=lambda kv: -kv[1])
               if delta > 0.005 * best.step.total][:2]
    tail = f" ({', '.join(reasons)} per step)" if reasons else ""
    return f"{alt.tokens_per_s:,.0f} tokens/s/device ({loss:+.0%}){tail}"


def explain(candidates: list[Candidate], experts: int = 0) -> list[str]:
    """Why the best layout wins and how the obvious alternatives (FSDP only, more TP, pipeline or not, with
    experts: expert parallelism or not) compare, with their numbers; `experts`: routed experts per block."""
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
        ("FSDP only", lambda x: x.tp == 1 and x.pp == 1 and x.dp_replicate == 1 and x.cp == 1 and x.ep == 1),
        (f"more TP (tp={lay.tp * 2})", lambda x: x.tp == lay.tp * 2),
        (f"less TP (tp={lay.tp // 2})", lambda x: lay.tp > 1 and x.tp == lay.tp // 2),
        ("with a pipeline" if lay.pp == 1 else "without a pipeline", lambda x: (x.pp > 1) != (lay.pp > 1)),
        ("no activation checkpointing" if lay.ac != "none" else "activation checkpointing",
         lambda x: (x.ac == "none") != (lay.ac == "none")),
        ("without context parallelism" if lay.cp > 1 else "with context parallelism",
         lambda x: (x.cp > 1) != (lay.cp > 1)),
    ]
    if experts:
        alternatives.append(("without expert parallelism" if lay.ep > 1 else "with expert parallelism",
                             lambda x: (x.ep > 1) != (lay.ep > 1)))
    if lay.dp() > 1:
        alternatives.append(("HSDP (replicas across nodes)" if lay.dp_replicate == 1 else "FSDP across all replicas",
                             lambda x: (x.dp_replicate > 1) != (lay.dp_replicate > 1) and x.tp == lay.tp
                             and x.pp == lay.pp and x.cp == lay.cp and x.ep == lay.ep))
    seen = {lay}
    for name, keep in alternatives:
        alt = _best(candidates, keep)
        if alt is None and name in ("FSDP only", f"more TP (tp={lay.tp * 2})"):
            lines.append(f"  {name}: no such layout: "
                         + (f"{lay.gpus()}-way data parallelism does not divide the batch" if name == "FSDP only"
                            else "the planner does not model tensor parallelism of mixture-of-experts blocks"
                            if experts
                            else "TP stays within a node and must divide the heads, KV heads and sequence"))
        if alt is None or alt.layout in seen:
            continue
        seen.add(alt.layout)
        lines.append(f"  {name}: best is {alt.layout.describe()}: {_versus(best, alt)}")
    dropped = len(candidates) - len(fitting)
    if dropped:
        lines.append(f"  {dropped} of {len(candidates)} layouts do not fit in {mem.usable / GIB:.1f} GiB usable")
    return lines


def check_runnable(work: Workload, layout: Layout) -> None:
    """What keel needs of a given layout to run it, each a one-line error naming the layout."""
    m, dp, where = work.model, layout.dp(), f"layout {layout.describe()}"
    _check_experts(work, layout, where)
    if m.n_heads % layout.tp or m.n_kv_heads % layout.tp or work.seq_len % layout.tp:
        raise KeelError(f"{where}: tp = {layout.tp} must divide the heads ({m.n_heads}), KV heads ({m.n_kv_heads}) "
                        f"and the sequence ({work.seq_len})")
    if not cp_fits_sequence(work, layout.tp, layout.cp):
        raise KeelError(f"{where}: cp = {layout.cp} must split the sequence ({work.seq_len}) into 2 × cp = "
                        f"{2 * layout.cp} equal chunks, each rank's {work.seq_len // layout.cp} tokens divisible by "
                        f"tp = {layout.tp}")
    if layout.pp > 1 and m.tie_embeddings:
        raise KeelError(f"{where}: a pipeline needs untied embeddings (model.tie_embeddings = false)")
    if m.n_layers < layout.pp * layout.v:
        raise KeelError(f"{where}: pp × v = {layout.pp * layout.v} stages need at least as many blocks, not "
                        f"{m.n_layers}")
    if work.global_batch % dp or (work.global_batch // dp) % layout.micro_batch:
        raise KeelError(f"{where}: the global batch of {work.global_batch} sequences must split into {dp} "
                        f"data-parallel ranks of whole micro-batches of {layout.micro_batch}")


def _check_experts(work: Workload, layout: Layout, where: str) -> None:
    """What keel needs of expert parallelism (keel.parallel.degrees, keel.config.checks)."""
    experts, ep = work.experts, layout.ep
    if ep > 1 and not experts:
        raise KeelError(f"{where}: ep = {ep} splits routed experts, but the model has none (model.moe.experts = 0); "
                        f"use ep = 1")
    if experts and layout.tp > 1:
        raise KeelError(f"{where}: tp = {layout.tp}: the planner does not model tensor parallelism of "
                        f"mixture-of-experts blocks (keel replicates them over the tensor-parallel ranks); use tp = 1")
    lender = f"dp_shard × cp = {layout.dp_shard} × {layout.cp}" if layout.cp > 1 else f"dp_shard = {layout.dp_shard}"
    if layout.shard() % ep:
        raise KeelError(f"{where}: ep = {ep} must divide {lender}: the expert-parallel ranks are borrowed from the "
                        f"ranks that shard the parameters")
    if experts % ep:
        raise KeelError(f"{where}: ep = {ep} must divide the {experts} routed experts of each block")


@dataclass(frozen=True)
class Assessed:
    """A given layout, predicted, and where it ranks among the searched ones."""

    candidate: Candidate
    rank: int | None  # 1 + the fitting searched layouts predicted faster (None: it does not fit, so not ranked)
    of: int  # the fitting layouts it is ranked among: the searched ones, and itself when it fits and is not one
    versus: str  # against the searched best

    def row(self) -> dict:
        c = self.candidate
        return {"layout": c.layout.describe(), "memory_gib": c.memory.total / GIB, "step_s": c.step.total,
                "tokens_per_s_per_gpu": c.tokens_per_s, "mfu": c.step.mfu, "rank": self.rank, "of": self.of,
                "versus_best": self.versus, "fits": c.fits, "memory_verdict": "" if c.fits else c.why}


def assess(work: Workload, layout: Layout, hw: Accelerator, eff: Efficiency, candidates: list[Candidate]
           ) -> Assessed:
    """The given layout's memory and step (also when it does not fit: `why` says so and what would), refused in
    one line when keel cannot run it."""
    check_runnable(work, layout)
    mem, step = memory(work, layout, hw), step_time(work, layout, hw, eff)
    given = Candidate(layout, mem, step, f"{step.explain()}; {mem.total / GIB:.1f} GiB" if mem.fits else
                      f"does not fit: {suggest(work, layout, hw)}")
    fitting = [c for c in candidates if c.fits]
    faster = sum(c.tokens_per_s > given.tokens_per_s * (1 + 1e-9) for c in fitting if c.layout != layout)
    searched = any(c.layout == layout for c in fitting)
    if not fitting or fitting[0].layout == layout:
        versus = "it is the best searched layout"
    else:
        best = fitting[0]
        versus = f"{_speed_versus(best, given)} against the best, {best.layout.describe()}"
    return Assessed(given, faster + 1 if given.fits else None, len(fitting) + (given.fits and not searched), versus)


def untied_alternative(work: Workload, gpus: int, hw: Accelerator, eff: Efficiency, best: Candidate | None) -> str:
    """With tied embeddings keel runs no pipeline (the first stage's embedding would be the last stage's output
    projection): what the same model untied would make with one, when that beats the best tied layout."""
    if not work.model.tie_embeddings:
        return ""
    untied = replace(work, model=replace(work.model, tie_embeddings=False))
    piped = next((c for c in search(untied, gpus, hw, eff) if c.fits and c.layout.pp > 1), None)
    if piped is None or (best is not None and piped.tokens_per_s <= best.tokens_per_s):
        return ""
    gain = f" ({piped.tokens_per_s / best.tokens_per_s - 1:+.0%})" if best is not None else ""
    return (f"  tied embeddings rule out pipeline layouts (keel does not share one weight between the first and "
            f"the last stage); untied (model.tie_embeddings = false, {untied.n_params / 1e9:.1f}B parameters), the "
            f"best is {piped.layout.describe()}: {piped.tokens_per_s:,.0f} tokens/s/device{gain}")
