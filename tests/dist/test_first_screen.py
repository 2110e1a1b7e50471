"""The first screen of `make train`: its command (the tiny config on 2 processes, a few steps) with port 9400
held by another process prints only the line kinds docs/monitoring.md lists, names the exporter's port
once, and announces no telemetry source that does not apply to the machine; a port set in the config and
taken is refused before any worker starts."""

from __future__ import annotations

import contextlib
import errno
import re
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from keel.rundir.events import read_jsonl
from tests.conftest import REPO, run_keel

pytestmark = pytest.mark.dist

DEFAULT_PORT = 9400

# The kinds of console line docs/monitoring.md ("What the console shows") lists, as patterns of a whole line.
LINE_KINDS = {
    "corpus": r"preparing the built-in corpus .*|(corpus|sources|documents|tokens) +\S.*|unigram entropy .*"
              r"|(clean and hash|decontaminate and tokenize)\b.*",
    "exporter": r"Prometheus metrics at http://\S+:\d+/metrics( \(port \d+ is taken\))?",
    "preflight": r"preflight: .*",
    "start": r"training \S+: .* run directory .*|resumed \S+ from \S+ at step \d+|initialised the weights from .*",
    "progress": r"step +\d+/\d+ \[[#.]{20}\] loss \d+\.\d{4} \| lr \S+ \| grad \S+ \| \S+ tok/s \| \S+ s/step \| "
                r"(MFU \d+\.\d% \| )?goodput \d+% \| (comm \d+% \| )?\S+ \| ETA \S+",
    "evaluation": r"step \d+: (validation loss \d+\.\d{4} \(\d+\.\d{4} bits per byte\)|downstream .*)",
    "checkpoint": r"checkpoint \S+ committed: .*",
    "guard": r"rolled back from step \d+ to step \d+ .*",
    "summary": r"finished \S+ at step \d+ after \S+ of training|  (train loss|tokens seen|run directory) .*"
               r"|run \S+ already finished at step \d+ .*",
    "warning": r"(keel: )?warning: .*",
    "error": r"(keel: )?error( \(rank \d+\))?: .*",
    "alert": r"ALERT \[\w+\] .*",
    "launcher": r"keel: .*",
}
LINE = re.compile("|".join(f"(?:{pattern})" for pattern in LINE_KINDS.values()))

# `make train`'s command, made short: the tiny config on 2 processes, ten steps of a smaller batch, with a
# progress line, an evaluation and a checkpoint every five.
FEW_STEPS = ["train.steps=10", "train.global_batch=8", "train.micro_batch=4", "monitor.interval=5",
             "eval.interval=5", "eval.sequences=8", "checkpoint.interval=5"]


@contextlib.contextmanager
def port_held(port: int) -> Iterator[None]:
    """`port` on loopback held by a listening socket other than keel's (or by whatever holds it already)."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            s.listen()
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                raise
        yield


def train_tiny(small_corpus: Path, run_dir: Path, *overrides: str) -> tuple[int, list[str]]:
    result = run_keel(["train", "--config", str(REPO / "configs" / "tiny.toml"), "--nproc", "2", "--run-dir",
                       str(run_dir), f"data.dir={small_corpus}", *FEW_STEPS, *overrides], cwd=run_dir.parent,
                      timeout=420)
    return result.returncode, (result.stdout + result.stderr).splitlines()


def test_the_first_screen_holds_only_documented_lines(small_corpus: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "tiny"
    with port_held(DEFAULT_PORT):
        code, console = train_tiny(small_corpus, run_dir)
    assert code == 0, "\n".join(console[-40:])
    assert [line for line in console if not LINE.fullmatch(line)] == [], "undocumented console lines"

    # The exporter moved past the held port and named the one it serves on, once.
    [exporter] = [line for line in console if line.startswith("Prometheus metrics at ")]
    served = int(re.search(r":(\d+)/metrics", exporter).group(1))
    assert served != DEFAULT_PORT and f"(port {DEFAULT_PORT} is taken)" in exporter
    assert sum(f":{served}" in line for line in console) == 1

    # A source that does not apply here is in the events and the log, never on the console.
    unavailable = [e["detail"] for e in read_jsonl(run_dir / "events.jsonl")
                   if e["kind"] == "telemetry" and e["action"] == "unavailable"]
    quiet = {d["source"] for d in unavailable if not d["applies"]}
    if not Path("/dev/nvidiactl").exists():
        assert "gpu" in quiet, unavailable  # a CPU machine: the GPU source does not apply
    said = [line for line in console if "unavailable" in line]
    assert not any(f" {source} unavailable" in line for line in said for source in quiet), said
    log = (run_dir / "logs" / "rank-0.log").read_text()
    assert all(f"telemetry: {source} does not apply here" in log for source in quiet)

    # No placeholders on the progress line; the internal lines are in the log only.
    progress = [line for line in console if line.startswith("step ") and "[" in line]
    assert len(progress) == 2 and not any("unknown" in line or "comm" in line for line in progress)
    if not Path("/dev/nvidiactl").exists():
        assert not any("MFU" in line for line in console)
        assert "MFU is left off the progress line" in log
    assert "watchdog timeouts" in log and not any("watchdog" in line for line in console)
    assert console[-4].startswith("finished tiny at step 10")


def test_a_port_set_and_taken_is_refused_before_any_worker_starts(small_corpus: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "taken"
    with port_held(DEFAULT_PORT):
        code, console = train_tiny(small_corpus, run_dir, f"monitor.prometheus_port={DEFAULT_PORT}")
    assert code == 2 and len(console) == 1, console
    assert console[0].startswith(f"keel: error: monitor.prometheus_port = {DEFAULT_PORT}: the exporter cannot serve "
                                 f"on 127.0.0.1:{DEFAULT_PORT}")
    assert not (run_dir / "logs").exists() and not (run_dir / "events.jsonl").exists(), "no worker started"
