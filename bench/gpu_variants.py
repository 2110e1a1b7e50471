"""The runs of bench/gpu_check.py, one line each, and what is computed across them: the ratios of keel to
torchtitan and to the bare loop, fp8 to bf16, and the run time each is expected to take on an H200.

A variant is a name, a model shape (a config in configs/), the runner (keel: `keel train --nproc 1`; bare:
bench/bare_loop_cuda.py; torchtitan: bench/titan_train.py in a subprocess) and keel overrides. A keel option
to compare is one more line here, e.g. Variant("1b keel NAME", "1b", overrides=("section.option=value",)).
"""

from __future__ import annotations

from dataclasses import dataclass

SHAPES = {"1b": "gpu_1b.toml", "3b": "gpu_3b.toml"}
RUNNERS = ("keel", "bare", "torchtitan")
# 1B: 20 steps; the runs that measure checkpoint blocking save at steps 10 and 20, the others at the last step
# only (keel always saves it). 3B: its config's 20 steps, one save at the last.
CHECKPOINTS_1B = ("train.steps=20", "checkpoint.interval=10")
LAST_SAVE_1B = ("train.steps=20", "checkpoint.interval=20")
# A mixture of experts of about the dense model's active parameters: 8 experts of half its width, 2 chosen, after
# one dense block; {half} is filled with half the shape's feed-forward width.
MOE = ("model.moe.experts=8", "model.moe.top_k=2", "model.moe.dense_layers=1", "model.moe.expert_dim={half}",
       "model.moe.bias_update_rate=0.001")


# Options of the one-device fast path (docs/precision.md, docs/parallel.md), each a keel variant of its own.
FAST_PATH = {
    "bf16 params": ("train.param_dtype=bf16", "train.precision=bf16"),  # bf16 is what auto means on CUDA
    "fused ce": ("train.cross_entropy=fused",),
    "sdpa flash": ("model.sdpa_backend=flash",),
    "sdpa cudnn": ("model.sdpa_backend=cudnn",),
    "max-autotune": ("parallel.compile_mode=max-autotune-no-cudagraphs",),
    "cuda graphs": ("parallel.compile_mode=reduce-overhead",),
    "op ac": ("parallel.activation_checkpoint=selective", "parallel.ac_selective=op"),
}


@dataclass(frozen=True)
class Variant:
    name: str
    shape: str
    runner: str = "keel"
    overrides: tuple[str, ...] = ()
    # "on": compiled, left out by --compile off; "off": eager, left out by --compile on; "default": compiled,
    # and eager under --compile off (compiling on a CPU takes minutes).
    compile: str = "default"

    def compiled(self, mode: str) -> bool | None:
        """Whether this variant compiles under --compile `mode`; None: it is left out."""
        if (self.compile == "on" and mode == "off") or (self.compile == "off" and mode == "on"):
            return None
        return self.compile != "off" and mode != "off"


# In the order they run: the comparisons first, so that a run the time budget leaves out is one of the extras.
VARIANTS = (
    Variant("1b keel", "1b", overrides=CHECKPOINTS_1B, compile="on"),
    Variant("1b bare", "1b", "bare", LAST_SAVE_1B),
    Variant("1b torchtitan", "1b", "torchtitan", LAST_SAVE_1B),
    Variant("1b keel fp8", "1b", overrides=("train.precision=fp8", *LAST_SAVE_1B)),
    Variant("3b keel", "3b"),
    Variant("3b bare", "3b", "bare"),
    Variant("3b torchtitan", "3b", "torchtitan"),
    Variant("3b keel fp8", "3b", overrides=("train.precision=fp8",)),
    Variant("1b keel eager", "1b", overrides=CHECKPOINTS_1B, compile="off"),
    Variant("1b keel moe", "1b", overrides=(*MOE, *LAST_SAVE_1B)),
    # The one-device fast path, each option against "1b keel" (its defaults): past the 9-minute budget, so run
    # with --only fastpath (or --budget-s 0).
    *(Variant(f"1b keel {name}", "1b", overrides=(*options, *LAST_SAVE_1B),
              compile="on" if "compile_mode" in options[0] else "default") for name, options in FAST_PATH.items()),
)
NAMES = {v.name for v in VARIANTS}
# (label, numerator, denominator) of tokens/s, each the variant named "{shape} ..." (the same FLOPs per token:
# the ratio of tokens/s is the ratio of MFU).
RATIOS = (("keel/torchtitan", "keel", "torchtitan"), ("keel/bare", "keel", "bare"), ("fp8/bf16", "keel fp8", "keel"),
          *((f"{name}/default", f"keel {name}", "keel") for name in FAST_PATH))
# Seconds a run takes on an H200 beside its steps: start-up (model, optimizer, keel's pinned checkpoint buffers,
# torchtitan's imports and CUDA graph capture), the per-block compile and keel's last save. Estimates from the
# measured 1.24B runs (about a minute each for 30 steps and two saves), not measurements.
OVERHEAD_S = {("keel", "1b"): 40, ("keel", "3b"): 55, ("bare", "1b"): 30, ("bare", "3b"): 40,
              ("torchtitan", "1b"): 45, ("torchtitan", "3b"): 60}
ASSUMED_MFU = 0.45  # of the steps, compiled (the 1.24B measured 48.5%); eager 0.40


def select(names: str) -> tuple[Variant, ...]:
    """The variants named (comma-separated names or shapes), in the table's order; "" for all."""
    if not names:
        return VARIANTS
    wanted = {n.strip() for n in names.split(",") if n.strip()}
    if "fastpath" in wanted:  # the defaults and each fast-path option
        wanted = (wanted - {"fastpath"}) | {"1b keel"} | {f"1b keel {name}" for name in FAST_PATH}
    known = {v.name for v in VARIANTS} | set(SHAPES)
    if unknown := sorted(wanted - known):
        raise ValueError(f"--only: no variant or shape {', '.join(unknown)} (known: {', '.join(sorted(known))})")
    return tuple(v for v in VARIANTS if v.name in wanted or v.shape in wanted)


def estimate_s(variant: Variant, steps: int, flops_per_step: float, peak_flops: float, compiled: bool) -> float:
    """The run's expected seconds on a device of `peak_flops` (bf16)."""
    return OVERHEAD_S[(variant.runner, variant.shape)] + steps * flops_per_step / (
        peak_flops * (ASSUMED_MFU if compiled else 0.40))


def ratios(runs: dict[str, dict], not_run: dict[str, str]) -> tuple[dict[str, float | None], dict[str, str]]:
    """Every ratio of RATIOS for every shape: its value, or None and why."""
    values: dict[str, float | None] = {}
    why: dict[str, str] = {}
    for shape in SHAPES:
        for label, top, bottom in RATIOS:
            key, names = f"{shape} {label}", (f"{shape} {top}", f"{shape} {bottom}")
            if not all(n in NAMES for n in names):  # the fast path is measured at 1B only
                continue
            tps = [runs.get(n, {}).get("figures", {}).get("tokens_per_s") for n in names]
            values[key] = tps[0] / tps[1] if tps[0] and tps[1] else None
            if values[key] is None:
                why[key] = "; ".join(f"{n}: {not_run.get(n, 'no tokens/s')}" for n, t in zip(names, tps, strict=True)
                                     if not t)
    return values, why
