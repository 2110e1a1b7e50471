"""Random bad input to `keel train`, in-process: every case exits 2 with one line on stderr, no traceback, and
leaves the working directory as it was. Only definitely-bad values are drawn, and training is replaced by a
failure, so a case that validation lets through fails at once instead of training."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import typing
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import keel.launch
import keel.train.worker
from keel import cli
from keel.config import INT_MAX, Config, SourceConfig
from tests.conftest import SMALL_RUN

FUZZ = settings(deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
TRAIN_FLAGS = ("--config", "--run-dir", "--resume", "--nproc", "--max-restarts", "--nnodes", "--rdzv-endpoint",
               "--quiet", "--help")


def scalar_fields(cls: type = Config, prefix: str = "") -> Iterator[tuple[str, typing.Any, dict]]:
    """(key, type, range and choices) of every option an override can set directly."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            yield from scalar_fields(tp, f"{prefix}{f.name}.")
        elif f.name == "sources":
            yield from scalar_fields(SourceConfig, f"{prefix}sources.main.")
        elif tp in (int, float, bool, str) or typing.get_origin(tp) is list:
            yield prefix + f.name, tp, dict(f.metadata)


FIELDS = list(scalar_fields())
LETTERS = st.text(st.characters(min_codepoint=ord("a"), max_codepoint=ord("z")), min_size=1, max_size=8)
NOT_A_NUMBER = st.one_of(LETTERS, st.sampled_from(["true", "false", "[1, 2]", "{a = 1}", '"7"', "1970-01-01"]))


def bad_int(meta: dict) -> st.SearchStrategy[str]:
    low, high = meta.get("ge"), meta.get("le") or INT_MAX
    out = [NOT_A_NUMBER, st.floats(allow_nan=False).filter(lambda v: not v.is_integer()).map(repr),
           st.integers(min_value=int(high) + 1).map(str)]
    if low is not None:
        out.append(st.integers(max_value=int(low) - 1).map(str))
    return st.one_of(out)


def bad_float(meta: dict) -> st.SearchStrategy[str]:
    out = [NOT_A_NUMBER, st.sampled_from(["inf", "-inf", "nan"])]
    if (ge := meta.get("ge")) is not None:
        out.append(st.floats(max_value=ge, allow_nan=False).filter(lambda v: v < ge).map(repr))
    if (gt := meta.get("gt")) is not None:
        out.append(st.floats(max_value=gt, allow_nan=False).map(repr))
    if (le := meta.get("le")) is not None:
        out.append(st.floats(min_value=le, allow_nan=False).filter(lambda v: v > le).map(repr))
    return st.one_of(out)


UNTEXT = st.one_of(st.sampled_from(["[1, 2]", "{a = 1}", '"a\\u0000b"', "x\udcff", "[]"]),
                   st.text(min_size=1, max_size=6).map(lambda t: f"{t}\udcfe"))


def bad_value(tp: typing.Any, meta: dict) -> st.SearchStrategy[str]:
    if tp is int:
        return bad_int(meta)
    if tp is float:
        return bad_float(meta)
    if tp is bool:
        return st.one_of(st.integers().map(str), st.floats(allow_nan=False).map(repr),
                         LETTERS.filter(lambda t: t not in ("true", "false")), st.just('"true"'))
    if tp is str and meta.get("choices"):  # plain letters and digits are taken as written, quoted or not
        alphanumeric = st.text("abcdefghijklmnopqrstuvwxyzNFCK0123456789", min_size=1, max_size=8)
        return st.one_of(UNTEXT, alphanumeric.filter(lambda t: t not in meta["choices"]))
    if tp is str:
        return UNTEXT
    return st.sampled_from(["5", '"x"', "true", "[1, 2]", "{a = 1}"])  # a list: any scalar, or ints as items


@st.composite
def bad_override(draw: st.DrawFn) -> str:
    key, tp, meta = draw(st.sampled_from(FIELDS))
    return f"{key}={draw(bad_value(tp, meta))}"


@st.composite
def unknown_key(draw: st.DrawFn) -> str:
    section, name = draw(st.sampled_from(["", "train.", "model.", "guard.spike.", "data.sources.main."])), draw(LETTERS)
    known = {key for key, _, _ in FIELDS} | {f.name for f in dataclasses.fields(Config)}
    if section + name in known or (not section and name in known):
        name += "_x"
    return draw(st.sampled_from([f"{section}{name}=1", "train.steps.deep=1", "model.dim.x=2"]))


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty working directory, beside a few inputs; training replaced by a failure."""
    def started(*args: typing.Any, **kwargs: typing.Any) -> typing.NoReturn:
        raise AssertionError("a bad input was accepted and training started")

    monkeypatch.setattr(keel.train.worker, "train", started)
    monkeypatch.setattr(keel.launch, "launch", started)
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    (inputs / "afile").write_text("not a directory")
    (inputs / "latin1.toml").write_bytes('name = "caf\xe9"\n'.encode("latin-1"))
    (inputs / "broken.toml").write_text("[train\nsteps = ")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    (cwd / "keep.txt").write_text("mine")
    monkeypatch.chdir(cwd)
    return inputs


def snapshot(*roots: Path) -> dict[str, tuple[int, int]]:
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for root in roots for p in [root, *root.rglob("*")]}


def assert_rejected(argv: list[str], *watched: Path) -> None:
    before = snapshot(Path.cwd(), *watched)
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            code = cli.main(argv)
        except SystemExit as e:  # argparse's own errors
            code = e.code
    lines = err.getvalue().splitlines()
    assert code == 2, (argv, code, err.getvalue())
    assert len(lines) == 1 and lines[0].startswith("keel: error: "), (argv, err.getvalue())
    assert "Traceback" not in err.getvalue() + out.getvalue()
    assert snapshot(Path.cwd(), *watched) == before, f"{argv} created or changed files"


def train_argv(small_corpus: Path) -> list[str]:
    return ["train", f"data.dir={small_corpus}", *SMALL_RUN, "train.steps=2"]


def test_the_fuzzed_start_is_valid_without_its_bad_input(workdir: Path, small_corpus: Path) -> None:
    """The base of every fuzzed case reaches training: what the cases add is what they are rejected for."""
    with pytest.raises(AssertionError, match="training started"):
        cli.main(train_argv(small_corpus))


@settings(FUZZ, max_examples=400)
@given(st.lists(st.one_of(bad_override(), unknown_key()), min_size=1, max_size=3))
def test_bad_overrides_are_one_line_and_create_nothing(workdir: Path, small_corpus: Path, bad: list[str]) -> None:
    assert_rejected(train_argv(small_corpus) + bad, small_corpus)  # after the good ones, which they would override


@st.composite
def bad_flag(draw: st.DrawFn, inputs: Path) -> list[str]:
    afile, proc = str(inputs / "afile"), f"/proc/{draw(LETTERS)}"
    choice = draw(st.sampled_from(["nproc", "restarts", "int", "resume", "run-dir", "checkpoint", "config",
                                   "unknown", "nnodes", "undecodable"]))
    if choice == "nproc":
        return ["--nproc", str(draw(st.integers(max_value=0)))]
    if choice == "restarts":
        return ["--max-restarts", str(draw(st.integers(max_value=-1)))]
    if choice == "int":
        return [draw(st.sampled_from(["--nproc", "--max-restarts"])), draw(st.one_of(LETTERS, st.just("1.5")))]
    if choice == "resume":
        return ["--resume", afile]
    if choice == "run-dir":
        return ["--run-dir", draw(st.sampled_from([afile, f"{afile}/{draw(LETTERS)}", proc]))]
    if choice == "checkpoint":
        return [f"checkpoint.dir={draw(st.sampled_from([proc, f'{afile}/run', f'file://{afile}']))}"]
    if choice == "config":
        name = draw(st.sampled_from(["latin1.toml", "broken.toml", "missing.toml", "afile/x.toml", ""]))
        return ["--config", str(inputs / name) if name else str(inputs)]
    if choice == "unknown":
        flag = "--" + draw(LETTERS)
        return [flag if not any(f.startswith(flag) for f in TRAIN_FLAGS) else flag + "-zz"]
    if choice == "nnodes":
        return ["--nnodes", draw(st.sampled_from(["0", "2:1", "x", "1:0"])), "--rdzv-endpoint", "127.0.0.1:29400"]
    config = inputs / "undecodable.toml"  # random bytes that are not UTF-8
    config.write_bytes(draw(st.binary(min_size=1, max_size=40).filter(lambda b: not _utf8(b))))
    return ["--config", str(config)]


def _utf8(data: bytes) -> bool:
    try:
        data.decode()
    except UnicodeDecodeError:
        return False
    return True


@settings(FUZZ, max_examples=150)
@given(st.data())
def test_bad_flags_and_paths_are_one_line_and_create_nothing(workdir: Path, small_corpus: Path,
                                                            data: st.DataObject) -> None:
    argv = train_argv(small_corpus)
    for flag in data.draw(st.lists(bad_flag(workdir), min_size=1, max_size=2)):
        argv[1:1] = flag
    assert_rejected(argv, small_corpus, workdir)


@pytest.mark.parametrize("out", ["afile/out", "afile", "/proc/x", "/sys/y/z"])
def test_export_to_a_path_that_cannot_be_a_directory(workdir: Path, out: str) -> None:
    assert_rejected(["ckpt", "export", str(workdir / "nowhere"), "--out", str(workdir / out)], workdir)
