"""The `keel` command line, in process: argument handling of config, data prepare and exit codes."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest
import torch

from keel.cli import main
from tests.conftest import REPO, SMALL_SOURCES


def test_overrides_may_come_before_between_and_after_options(capsys: pytest.CaptureFixture) -> None:
    code = main(["config", "train.steps=5", "--config", str(REPO / "configs/small.toml"), "optim.lr=1e-4"])
    assert code == 0
    resolved = tomllib.loads(capsys.readouterr().out)
    assert resolved["name"] == "small"
    assert resolved["train"]["steps"] == 5 and resolved["optim"]["lr"] == 1e-4


def test_unknown_option_is_a_usage_error(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["config", "--bogus"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        "keel: error: unrecognized arguments: --bogus (`keel --help` lists the arguments)"]


def test_a_path_the_user_named_that_cannot_be_written_is_one_line(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "afile").write_text("")
    html = tmp_path / "afile" / "plan.html"
    assert main(["plan", "--gpus", "8", "--tokens", "1e9", "--trials", "10", "--html", str(html)]) == 2
    out, err = capsys.readouterr()
    assert err.splitlines() == [f"keel: error: --html {str(html)!r} cannot be created: {str(html.parent)!r} is a "
                                f"file; pass a path under a directory"], err
    assert out == "", "the plan is not printed before its --html path is refused"


def test_bad_override_exits_2_with_one_line(capsys: pytest.CaptureFixture) -> None:
    assert main(["config", "train.stpes=3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["keel: error: unknown config key 'stpes' in [train]; did you mean 'steps'?"]


def test_data_prepare_prints_statistics_with_the_unigram_entropy(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "corpus"
    assert main(["data", "prepare", "--source", SMALL_SOURCES[0], "--source", SMALL_SOURCES[1], "--out", str(out),
                 "data.val_fraction=0.1"]) == 0
    printed = capsys.readouterr().out
    assert (out / "manifest.json").is_file()
    assert "unigram entropy" in printed and "nats/token" in printed
    assert main(["data", "prepare", "--source", SMALL_SOURCES[0], "--out", str(out)]) == 2, \
        "other sources into an existing corpus need --force"
    assert "--force" in capsys.readouterr().err

    assert main(["data", "stats", str(out)]) == 0
    printed = capsys.readouterr().out
    for line in ("documents in", "removed by filter", "exact duplicates", "near duplicates", "P(candidate | J)",
                 "decontaminated", "documents out", "source main", "document length in tokens"):
        assert line in printed, line
    assert main(["data", "stats", str(out), "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats == json.loads((out / "stats.json").read_text())
    assert stats["documents_in"] == stats["documents_out"] + stats["exact_duplicates"] + stats["near_duplicates"] + \
        stats["decontaminated"] + sum(stats["removed_by_filter"].values())
    assert main(["data", "stats", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a prepared corpus" in err[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_asking_for_cuda_without_it_is_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    run_dir = tmp_path / "run"
    assert main(["train", "--nproc", "2", "--run-dir", str(run_dir), "train.device=cuda"]) == 2
    assert "no usable CUDA device" in capsys.readouterr().err
    assert not run_dir.exists()


@pytest.mark.parametrize(("flags", "expect"), [
    (["--tokens", "nan"], "--tokens nan: expected a token budget above 0"),
    (["--tokens", "inf"], "--tokens inf: expected a token budget above 0"),
    (["--tokens", "1e30"], "at most 1e+16"),
    (["--tokens", "1e9", "--storage-gbps", "0"], "--storage-gbps 0.0: expected a finite number above 0"),
    (["--tokens", "1e9", "--storage-gbps", "-3"], "--storage-gbps -3.0: expected a finite number above 0"),
    (["--tokens", "1e9", "--mtbf-hours", "-1"], "--mtbf-hours -1.0: expected a finite number above 0"),
    (["--tokens", "1e9", "--price", "nan"], "--price nan: expected a finite number at least 0"),
    (["--tokens", "1e9", "--net-gbps", "0"], "--net-gbps 0.0: expected a finite number above 0"),
    (["--tokens", "1e9", "--detect-s", "-5"], "--detect-s -5.0: expected a finite number at least 0"),
    (["--tokens", "1e9", "--restart-s", "inf"], "--restart-s inf: expected a finite number"),
    (["--tokens", "1e9", "--repair-h", "1e9"], "--repair-h 1000000000.0: expected a finite number at least 0 and "
                                               "at most 8760"),
    (["--tokens", "1e9", "--fragmentation", "nan"], "--fragmentation nan: expected a finite number at least 0 and "
                                                    "at most 1"),
    (["--tokens", "1e9", "--memory-coverage", "2"], "--memory-coverage 2.0: expected a finite number at least 0 and "
                                                     "at most 1"),
    (["--tokens", "1e9", "--spares", "-1"], "--spares '-1': expected auto or a number of spare nodes"),
    (["--tokens", "1e9", "--spares", "many"], "--spares 'many': expected auto or a number of spare nodes"),
    (["--tokens", "1e9", "--trials", "0"], "--trials 0: expected between 1 and"),
    (["--tokens", "1e9", "--trials", "-2"], "--trials -2: expected between 1 and"),
    (["--tokens", "1e9", "--seed", "-1"], "--seed -1: expected 0 or a positive integer"),
])
def test_plan_numbers_out_of_range_are_one_line(flags: list[str], expect: str, capsys: pytest.CaptureFixture) -> None:
    assert main(["plan", "--gpus", "8", *flags]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and expect in err[0], err
