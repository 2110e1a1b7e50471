"""Human-facing output: the per-rank log file, rank 0's progress lines and the final summary."""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path


def format_duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s" if m else f"{s}s"


def format_count(n: float) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.1f}{unit}"
    return f"{n:.0f}"


LOUD = ("error", "warning", "ALERT", "keel:")  # what --quiet still shows


class Progress:
    """Writes every message to logs/rank-R.log; rank 0 also prints it: on a terminal the progress line
    redraws in place, elsewhere (CI logs, files) each is a plain line; under --quiet (KEEL_QUIET) only
    warnings, errors and alerts reach the console. `log` writes to the file alone: what a person looking
    into the run wants (timeouts, where MFU's peak came from), not one watching it start."""

    def __init__(self, log_path: Path, echo: bool, layout: str = "") -> None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.layout = layout  # shown on each progress line
        self.mfu_shown = True  # whether MFU's peak is one the progress line shows MFU against (keel.monitor.mfu)
        self.file = open(log_path, "a", buffering=1)  # noqa: SIM115 - open for the whole run, closed by close()
        self.echo = echo
        self.quiet = os.environ.get("KEEL_QUIET") == "1"
        self.tty = sys.stdout.isatty()
        self._bar_shown = False  # a progress line is on the terminal, without its newline

    def log(self, message: str) -> None:
        self.file.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {message}\n")

    def __call__(self, message: str, bar: bool = False) -> None:
        self.log(message)
        if not self.echo or (self.quiet and not message.startswith(LOUD)):
            return
        if bar and self.tty:
            sys.stdout.write(f"\r{message}\x1b[K")
            sys.stdout.flush()
            self._bar_shown = True
            return
        if self._bar_shown:
            sys.stdout.write("\n")
            self._bar_shown = False
        print(message, file=sys.stdout, flush=True)

    def close(self) -> None:
        if self._bar_shown:
            sys.stdout.write("\n")
            sys.stdout.flush()
        self.file.close()

    def lines(self, messages: list[str]) -> None:
        for message in messages:
            self(message)

    def step(self, step: int, total: int, record: dict) -> None:
        """The progress line. MFU only against a peak it can be read against and when this interval has one,
        the share of time in collectives only once a step was profiled: never a placeholder."""
        width = 20
        done = int(width * step / total)
        eta = (total - step) * record["time/step_s"]
        mfu = record.get("throughput/mfu") if self.mfu_shown else None
        comm = record.get("time/comm_share")
        self(f"step {step:>{len(str(total))}}/{total} [{'#' * done}{'.' * (width - done)}] "
             f"loss {record['train/loss']:.4f} | lr {record['optim/lr']:.2e} | grad {record['optim/grad_norm']:.3f} | "
             f"{format_count(record['throughput/tokens_per_s'])} tok/s | {record['time/step_s']:.3f} s/step | "
             + ("" if mfu is None else f"MFU {mfu:.1%} | ")
             + f"goodput {record.get('goodput/ratio', float('nan')):.0%} | "
             + ("" if comm is None else f"comm {comm:.0%} | ")
             + f"{self.layout} | ETA {format_duration(eta)}", bar=True)


def summary_lines(s: dict) -> list[str]:
    evaluated = isinstance(s.get("val_loss"), (int, float)) and math.isfinite(s["val_loss"])
    validation = (f"validation loss {s['val_loss']:.4f} nats/token" if evaluated else
                  "no validation (eval.final = false)")
    return [
        f"finished {s['name']} at step {s['step']} after {format_duration(s['train_seconds'])} of training",
        f"  train loss {s['train_loss']:.4f} · {validation} (unigram entropy of the corpus "
        f"{s['unigram_entropy']:.4f})"
        + (f" · {s['val_bpb']:.4f} bits per byte ({s['tokenizer']} tokenizer)" if evaluated and "val_bpb" in s
           else ""),
        f"  tokens seen {s['tokens_seen']:,} · {format_count(s['tokens_per_s'])} tokens/s",
        f"  run directory {s['run_dir']} · latest checkpoint {s['checkpoint']}",
    ]
