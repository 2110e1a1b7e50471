"""torchtitan beside keel in bench/gpu_check.py: the spec bench/titan_train.py runs from a keel config, the
command that launches it, and what its log says (tokens/s, reserved memory).

torchtitan 0.3.0 (`pip install torchtitan==0.3.0`, Python >= 3.11) trains on CUDA devices only: its
torchtitan.tools.utils falls back to "cuda" when torch finds no accelerator, and it imports triton. Its Llama 3
flavours "1B" and "3B" (torchtitan/models/llama3/__init__.py) have Llama 3.2's shapes, which configs/gpu_1b.toml
and configs/gpu_3b.toml are; its parameter count and FLOPs per token for them equal keel's
(keel.model.flops), checked on the meta device.
"""

from __future__ import annotations

import importlib.util
import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

from keel.config import Config, ffn_hidden_dim

ENTRY = Path(__file__).resolve().with_name("titan_train.py")
VERSION = "0.3.0"
# torchtitan 0.3.0's Llama 3 flavours: (dim, layers, heads, kv heads, FFN hidden, vocabulary, tied embeddings).
FLAVOURS = {"1B": (2048, 16, 32, 8, 8192, 128256, True), "3B": (3072, 28, 24, 8, 8192, 128256, True)}
# A line of its log, as torchtitan/components/metrics.py (MetricsProcessor.log) writes it with colours off,
# under torchtitan/tools/logging.py's prefix. Recorded from that source: no GPU has printed it here yet.
SAMPLE_LOG = ("[titan] 2026-12-05 17:40:12,345 - root - INFO - step: 10  loss:  9.87654  grad_norm:  1.2345  "
              "memory: 48.21GiB(33.95%)  tps: 57,312  tflops: 471.12  mfu: 47.61%")
LINE = re.compile(r"step:\s*(?P<step>\d+)\s+loss:\s*(?P<loss>\S+)\s+grad_norm:\s*\S+\s+"
                  r"memory:\s*(?P<gib>[\d.]+)GiB\([\d.]+%\)\s+tps:\s*(?P<tps>[\d,]+)\s+tflops:\s*[\d.,]+\s+"
                  r"mfu:\s*(?P<mfu>[\d.]+%|N/A)")
GIB = 2**30


def flavour(cfg: Config) -> str | None:
    """The torchtitan flavour of exactly this model's shapes, or None."""
    m = cfg.model
    shapes = (m.dim, m.n_layers, m.n_heads, m.n_kv_heads, ffn_hidden_dim(m), m.vocab_size, m.tie_embeddings)
    plain = not (m.moe.experts or m.head_dim or m.ffn_dim)
    return next((name for name, known in FLAVOURS.items() if known == shapes and plain), None)


def spec(cfg: Config, dump_folder: Path, compile_on: bool) -> dict:
    """What bench/titan_train.py needs: the flavour and the run of the keel config `cfg`."""
    name = flavour(cfg)
    if name is None:
        raise ValueError(f"torchtitan {VERSION} has no Llama 3 flavour of {cfg.name}'s shapes (it has "
                         f"{', '.join(FLAVOURS)})")
    m, t = cfg.model, cfg.train
    return {"flavor": name, "dim": m.dim, "n_layers": m.n_layers, "n_heads": m.n_heads, "n_kv_heads": m.n_kv_heads,
            "ffn_hidden": ffn_hidden_dim(m), "vocab_size": m.vocab_size, "tie_embeddings": m.tie_embeddings,
            "seq_len": t.seq_len, "micro_batch": t.micro_batch, "global_batch": t.global_batch, "steps": t.steps,
            "log_freq": cfg.monitor.interval, "lr": cfg.optim.lr, "warmup_steps": cfg.optim.warmup_steps,
            "grad_clip": cfg.optim.grad_clip, "compile": compile_on, "dump_folder": str(dump_folder)}


def command(spec_path: Path) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", str(ENTRY),
            str(spec_path)]


def windows(log: str) -> list[dict]:
    """Each logged step of torchtitan's log: step, loss, tokens/s, peak reserved bytes of the window, MFU
    (torchtitan's own, None when it prints N/A)."""
    out = []
    for match in LINE.finditer(log):
        mfu = match["mfu"]
        out.append({"step": int(match["step"]), "loss": float(match["loss"]),
                    "tokens_per_s": float(match["tps"].replace(",", "")),
                    "peak_reserved_bytes": float(match["gib"]) * GIB,
                    "titan_mfu": None if mfu == "N/A" else float(mfu.rstrip("%")) / 100})
    return out


def summary(logged: list[dict]) -> dict:
    """tokens/s: the median of the windows after the first (compile, CUDA graph capture); the peak reserved
    memory: the largest window's (torchtitan resets the peak after each log line)."""
    steady = [w["tokens_per_s"] for w in logged[1:]]
    mfu = [w["titan_mfu"] for w in logged[1:] if w["titan_mfu"] is not None]
    return {"tokens_per_s": statistics.median(steady) if steady else None,
            "titan_mfu": statistics.median(mfu) if mfu else None,
            "peak_reserved_bytes": max((w["peak_reserved_bytes"] for w in logged), default=None),
            "windows": len(logged)}


def unavailable(cuda: bool) -> str:
    """Why torchtitan cannot run here, or "" when it can be tried."""
    if importlib.util.find_spec("torchtitan") is None:
        return (f"torchtitan is not installed (torchtitan=={VERSION} and its requirements as wheels: "
                "bench/gpu_check.py's docstring)")
    if not cuda:
        return f"torchtitan {VERSION} trains on a CUDA device only"
    return ""


def run(spec_of: dict, work: Path, timeout_s: float) -> dict:
    """torchtitan's trainer in a subprocess; its log kept in `work`."""
    work.mkdir(parents=True, exist_ok=True)
    spec_path = work / "spec.json"
    spec_path.write_text(json.dumps(spec_of, indent=1) + "\n")
    try:
        done = subprocess.run(command(spec_path), capture_output=True, text=True, timeout=timeout_s)
        log, code = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as e:
        parts = [p.decode(errors="replace") if isinstance(p, bytes) else p or "" for p in (e.stdout, e.stderr)]
        log, code = "".join(parts), 124
    (work / "titan.log").write_text(log)
    logged = windows(log)
    errors = [line for line in log.splitlines() if re.search(r"Error|error:|SystemExit", line)]
    return {"exit_code": code, **summary(logged), "error": errors[-1].strip() if code and errors else None}
