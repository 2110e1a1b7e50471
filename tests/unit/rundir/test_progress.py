"""The console: plain progress lines off a terminal and when quiet, one redrawn bar on a terminal, and
the log file with everything."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from keel.rundir.progress import Progress

RECORD = {"train/loss": 2.5, "optim/lr": 1e-3, "optim/grad_norm": 0.5, "throughput/tokens_per_s": 5000.0,
          "time/step_s": 0.1, "throughput/mfu": 0.2, "goodput/ratio": 0.9}


def test_console_plain_lines_off_a_terminal_and_quiet(tmp_path: Path, capsys, monkeypatch) -> None:
    progress = Progress(tmp_path / "rank-0.log", echo=True)
    progress.step(5, 10, RECORD)
    progress("checkpoint committed")
    monkeypatch.setenv("KEEL_QUIET", "1")
    quiet = Progress(tmp_path / "rank-0.log", echo=True)
    quiet.step(6, 10, RECORD)
    quiet("warning: the alert webhook failed")
    quiet("checkpoint committed")
    progress.close()
    quiet.close()
    out = capsys.readouterr().out
    assert "\r" not in out
    lines = out.splitlines()
    assert lines[0].startswith("step  5/10 [##########..........] loss 2.5000") and "MFU 20.0%" in lines[0]
    assert "goodput 90%" in lines[0] and "ETA 0s" in lines[0]
    assert lines[1:] == ["checkpoint committed", "warning: the alert webhook failed"]
    assert (tmp_path / "rank-0.log").read_text().count("] loss") == 2, "the log file has everything"


def test_console_redraws_one_progress_line_on_a_terminal(tmp_path: Path, monkeypatch) -> None:
    leader, follower = os.openpty()
    with open(follower, "w", closefd=True) as tty:
        monkeypatch.setattr(sys, "stdout", tty)
        progress = Progress(tmp_path / "rank-0.log", echo=True)
        progress.step(1, 10, RECORD)
        progress.step(2, 10, RECORD)
        progress("validation loss 2.4")
        progress.close()
    out = _read_all(leader).decode().replace("\r\n", "\n")  # the terminal turns \n into \r\n
    assert out.count("\r") == 2 and "step  2/10" in out
    assert out.index("step  2/10") < out.index("\n") < out.index("validation loss"), "a message ends the bar line"


def _read_all(leader: int) -> bytes:
    """Everything written to the terminal: one read may return only the first chunk, and the leader
    reports EIO once the follower is closed and drained."""
    chunks = []
    try:
        while chunk := os.read(leader, 65536):
            chunks.append(chunk)
    except OSError:
        pass
    os.close(leader)
    return b"".join(chunks)


def test_the_progress_line_has_no_placeholders(tmp_path: Path, capsys) -> None:
    progress = Progress(tmp_path / "rank-0.log", echo=True, layout="dp_shard2")
    progress.step(1, 10, RECORD)  # no profile yet: no comm
    progress.step(2, 10, {**RECORD, "time/comm_share": 0.25})
    progress.step(3, 10, {**RECORD, "throughput/mfu": None})  # an interval without MFU (unknown peak)
    progress.mfu_shown = False  # a CPU's measured peak: MFU stays in the record, off the line
    progress.step(4, 10, {**RECORD, "time/comm_share": 0.25})
    progress.log("watchdog timeouts: only in the log")
    progress.close()
    first, second, third, fourth = capsys.readouterr().out.splitlines()
    assert "MFU 20.0% | goodput 90% | dp_shard2 | ETA" in first and "comm" not in first
    assert "MFU 20.0% | goodput 90% | comm 25% | dp_shard2 | ETA" in second
    assert "| s/step | goodput 90% | dp_shard2 |" in third.replace("0.100 ", "") and "unknown" not in third
    assert "| goodput 90% | comm 25% |" in fourth and "MFU" not in fourth
    assert "watchdog timeouts: only in the log" in (tmp_path / "rank-0.log").read_text()
