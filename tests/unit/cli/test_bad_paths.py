"""Every path every command takes, input or output, is refused in one line when it is bad. A seeded fuzz drives
each path argument of each command, and each path field of the config, with generated bad paths of every kind
(empty, over the system's length limits, a symbolic link loop, a link to nothing, under a file, missing, of the
wrong kind, a named pipe, on a kernel or a read-only file system, unreadable) and checks that the command exits
2 with one line naming the argument, prints nothing else, shows no traceback and creates or changes nothing."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import random
import shutil
import string
import subprocess
import sys
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import keel.launch
import keel.plan.measure
import keel.sweep.run
import keel.train.worker
from keel import cli
from keel.cli.pathargs import PathArg
from tests.conftest import SMALL_RUN, keel_env, run_keel

SEED = 41  # the fuzz draws the same paths on every run; a failure names its case
ROUNDS = 2  # draws of every kind for every path


@dataclass(frozen=True)
class Slot:
    """One path a command takes: the command line with {} where the path goes, what the command does with it
    (reads a file, a directory or either; writes a directory or a file), and how its error line names it."""

    arg: tuple[str, str]  # (command, argument): a parser's path argument, or a config field
    argv: tuple[str, ...]
    kind: str  # in_file, in_dir, in_any, out_dir, out_file
    named: str
    empty_means_unset: bool = False  # '' is the default there (checkpoint.dir): not a bad path
    suffix: str = ""  # what the config needs after the path to take it as one (data.tokenizer's .json)


@dataclass(frozen=True)
class World:
    """The watched directory: the working directory, inputs of every kind, and a read-only volume."""

    root: Path
    corpus: Path
    readonly: Path | None  # a read-only mounted file system, None where mounting is not allowed

    @property
    def afile(self) -> Path:
        return self.root / "in" / "afile.toml"

    @property
    def adir(self) -> Path:
        return self.root / "in" / "adir"


def slots(w: World) -> list[Slot]:
    run, src, new = str(w.adir), str(w.root / "in" / "src"), str(w.root / "new")
    train = ("train", "--run-dir", f"{new}/run", f"data.dir={w.corpus}", *SMALL_RUN, "train.steps=2")
    prep = ("data", "prepare", "--source", src, "--out", f"{new}/corpus", "--workers", "1")
    plan = ("plan", "--gpus", "8", "--tokens", "1e9", "--trials", "10")
    grid = ("sweep", "--grid", "optim.lr=1e-3,2e-3", "--steps", "1", f"data.dir={w.corpus}", *SMALL_RUN)

    def s(arg: str, argv: tuple[str, ...], kind: str, named: str = "", **kw: object) -> Slot:
        return Slot((argv[0] if argv[0] not in ("data", "ckpt") else " ".join(argv[:2]), arg), argv, kind,
                    named or arg, **kw)  # type: ignore[arg-type]

    return [
        s("--config", ("train", "--config", "{}", *train[1:]), "in_file"),
        s("--run-dir", ("train", "--run-dir", "{}", *train[3:]), "out_dir"),
        s("--resume", (*train, "--resume", "{}"), "in_dir"),
        s("data.dir", (*train, "data.dir={}"), "in_dir", "data directory"),
        s("checkpoint.dir", (*train, "checkpoint.dir={}"), "out_dir", empty_means_unset=True),
        s("model.init_from", (*train, "model.init_from=hf:{}"), "in_dir"),
        s("eval.downstream_include", (*train, 'eval.downstream_tasks=["arc_easy"]', 'eval.downstream_include=["{}"]'),
          "in_dir"),
        s("--config", ("data", "prepare", "--config", "{}", *prep[2:]), "in_file"),
        s("--source", ("data", "prepare", "--source", "{}", *prep[4:]), "in_any"),
        s("--out", (*prep[:4], "--out", "{}"), "out_dir"),
        s("data.dir", (*prep[:4], "data.dir={}"), "out_dir"),
        s("data.sources", ("data", "prepare", *prep[4:], 'data.sources.main.paths=["{}"]'), "in_any",
          "source 'main': path"),
        s("data.tokenizer", (*prep, "data.tokenizer={}"), "in_file", "tokenizer file", suffix=".json"),
        s("data.decontam.eval_files", (*prep, 'data.decontam.eval_files=["{}"]'), "in_any", "source 'eval': path"),
        s("dir", ("data", "stats", "{}"), "in_dir", "DIR"),
        s("path", ("ckpt", "ls", "{}"), "in_dir", "PATH"),
        s("path", ("ckpt", "verify", "{}"), "in_dir", "PATH"),
        s("path", ("ckpt", "export", "{}", "--out", f"{new}/hf"), "in_dir", "PATH"),
        s("--out", ("ckpt", "export", run, "--out", "{}"), "out_dir"),
        s("--tokenizer", ("ckpt", "export", run, "--out", f"{new}/hf", "--tokenizer", "{}"), "in_any"),
        s("--config", (*plan, "--config", "{}"), "in_file"),
        s("--cluster", (*plan, "--cluster", "{}"), "in_file"),
        s("--calibrate", (*plan, "--calibrate", "{}"), "in_dir"),
        s("--sweep", (*plan, "--sweep", "{}"), "in_dir"),
        s("--html", (*plan, "--html", "{}"), "out_file"),
        s("--measure-dir", (*plan, "--measure", "1", "--measure-dir", "{}"), "out_dir"),
        s("target", ("eval", "{}", "--tasks", "arc_easy"), "in_dir", "TARGET"),
        s("--include", ("eval", run, "--tasks", "arc_easy", "--include", "{}"), "in_dir"),
        s("--tokenizer", ("eval", run, "--tasks", "arc_easy", "--tokenizer", "{}"), "in_any"),
        s("--out", ("eval", run, "--tasks", "arc_easy", "--out", "{}"), "out_file"),
        s("run_dirs", ("report", "{}"), "in_dir", "RUN_DIR"),
        s("run_dirs", ("report", run, "{}"), "in_dir", "RUN_DIR"),
        s("--out", ("report", run, "--out", "{}"), "out_file"),
        s("run_dir", ("status", "{}"), "in_dir", "RUN_DIR"),
        s("run_dir", ("pause", "{}"), "in_dir", "RUN_DIR"),
        s("run_dir", ("quarantine", "{}", "node-1"), "in_dir", "RUN_DIR"),
        s("root", ("runs", "{}"), "in_dir", "DIR"),
        s("--config", ("sweep", "--config", "{}", *grid[1:]), "in_file"),
        s("--out", (*grid, "--out", "{}"), "out_dir"),
        s("--out", ("sweep", "--coord-check", "--steps", "1", "--out", "{}"), "out_dir"),
        s("--config", ("drill", "--list", "--config", "{}"), "in_file"),
        s("--workdir", ("drill", "--list", "--workdir", "{}"), "out_dir"),
        s("--config", ("config", "--config", "{}"), "in_file"),
    ]


# ---------------------------------------------------------------- the bad paths, drawn

def letters(rng: random.Random, least: int = 3, most: int = 10) -> str:
    return "".join(rng.choices(string.ascii_letters + string.digits + "-_.", k=rng.randint(least, most))).lstrip(".")


def long_path(rng: random.Random, w: World) -> str:
    """More bytes than PATH_MAX, in names each within NAME_MAX."""
    parts = [str(w.root)]
    while sum(len(p) + 1 for p in parts) <= 4096 + rng.randint(0, 600):
        parts.append(letters(rng, 50, 255))
    return "/".join(parts)


def long_name(rng: random.Random, w: World) -> str:
    """One name over NAME_MAX, wherever in the path."""
    name = letters(rng, 256, 700)
    return rng.choice([f"{w.root}/{name}", f"{w.root}/{name}/{letters(rng)}", name])


def under(rng: random.Random, base: Path) -> str:
    return str(base.joinpath(*[letters(rng) for _ in range(rng.randint(0, 2))]))


# kind of bad path -> (the slot kinds it applies to, how to draw one)
BAD: dict[str, tuple[str, Callable[[random.Random, World, Slot], str]]] = {
    "empty": ("in_file in_dir in_any out_dir out_file", lambda rng, w, slot: ""),
    "long path": ("in_file in_dir in_any out_dir out_file", lambda rng, w, slot: long_path(rng, w)),
    "long name": ("in_file in_dir in_any out_dir out_file", lambda rng, w, slot: long_name(rng, w)),
    "link loop": ("in_file in_dir in_any out_dir out_file", lambda rng, w, slot: under(rng, w.root / "in" / "loop")),
    "link to nothing": ("in_file in_dir in_any out_dir out_file",
                        lambda rng, w, slot: str(w.root / "in" / "dangling")),
    "under a file": ("in_file in_dir in_any out_dir out_file",
                     lambda rng, w, slot: f"{w.afile}/{under(rng, Path(letters(rng)))}"),
    "missing": ("in_file in_dir in_any", lambda rng, w, slot: under(rng, w.root / "in" / f"missing-{letters(rng)}")),
    "a directory for a file": ("in_file out_file", lambda rng, w, slot: str(w.adir)),
    "a file for a directory": ("in_dir out_dir", lambda rng, w, slot: str(w.afile)),
    "a named pipe": ("in_file in_dir in_any out_dir out_file", lambda rng, w, slot: str(w.root / "in" / "fifo")),
    "kernel file system": ("out_dir out_file", lambda rng, w, slot: rng.choice(
        [f"/proc/{letters(rng)}", f"/proc/self/{letters(rng)}/{letters(rng)}", f"/sys/{letters(rng)}",
         "/proc/self/comm" if slot.kind == "out_file" else f"/proc/{letters(rng)}"])),
    "read-only file system": ("out_dir out_file", lambda rng, w, slot: rng.choice(
        [under(rng, w.readonly / f"new-{letters(rng)}"),
         str(w.readonly / ("existing_dir" if slot.kind == "out_dir" else "existing_file"))]) if w.readonly else ""),
}


def cases(w: World, seed: int, kinds: set[str]) -> Iterator[tuple[Slot, str, str]]:
    """(slot, kind of bad path, the path): each of `kinds` that applies to every slot, ROUNDS draws each."""
    rng = random.Random(seed)
    for slot in slots(w):
        for kind, (applies, draw) in BAD.items():
            if kind not in kinds or slot.kind not in applies.split() or (kind == "empty" and slot.empty_means_unset):
                continue
            for _ in range(ROUNDS if kind not in ("empty", "link to nothing", "a named pipe") else 1):
                yield slot, kind, draw(rng, w, slot) + slot.suffix


# ---------------------------------------------------------------- running a case

def snapshot(*roots: Path) -> dict[str, tuple[int, int, int]]:
    """Every entry under `roots`, links not followed: its type and permissions, size and modification time."""
    seen = {}
    for root in roots:
        for top, dirs, files in os.walk(root):
            for name in [top, *(os.path.join(top, n) for n in dirs + files)]:
                st = os.lstat(name)
                seen[name] = (st.st_mode, st.st_size, st.st_mtime_ns)
    return seen


def problem_of(argv: list[str], named: str, *watched: Path) -> str:
    """Run `keel ARGV` in this process; what is wrong with how it refused, "" when nothing is."""
    before = snapshot(*watched)
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            code = cli.main(argv)
        except SystemExit as e:
            code = e.code
        except BaseException:  # noqa: BLE001 - a traceback is what the case reports
            code = traceback.format_exc(limit=-3)
    lines, problems = err.getvalue().splitlines(), []
    if code != 2:
        problems.append(f"exit {code!r}")
    if len(lines) != 1 or not lines[0].startswith("keel: error: ") or named not in lines[0]:
        problems.append(f"stderr {err.getvalue()[-600:]!r} (one line naming {named!r} expected)")
    if out.getvalue():
        problems.append(f"stdout {out.getvalue()[:200]!r}")
    if "Traceback" in err.getvalue() + out.getvalue():
        problems.append("a traceback")
    if (after := snapshot(*watched)) != before:
        changed = sorted(set(after.items()) ^ set(before.items()))[:3]
        problems.append(f"created or changed {changed}")
    return "; ".join(problems)


def shown_argv(argv: list[str]) -> str:
    return " ".join(a if len(a) < 60 else f"{a[:30]}…({len(a)})" for a in argv)


def run_cases(todo: list[tuple[list[str], str, str]], *watched: Path) -> list[str]:
    """(argv, what the error names, a label) each run; the failures, one line each."""
    return [f"{label}: keel {shown_argv(argv)}: {problem}" for argv, named, label in todo
            if (problem := problem_of(argv, named, *watched))]


def started(*args: object, **kwargs: object) -> None:
    raise AssertionError("a bad path was accepted and the work started")


def keep_work_from_starting(monkeypatch: pytest.MonkeyPatch) -> None:
    """Training, a sweep's points and a plan's measured runs fail at once: a bad path let through shows as a
    failure, not a run."""
    for module, name in ((keel.train.worker, "train"), (keel.launch, "launch"), (keel.sweep.run, "run_points"),
                         (keel.plan.measure, "measure")):
        monkeypatch.setattr(module, name, started)


# ---------------------------------------------------------------- the world

@contextlib.contextmanager
def readonly_volume(mount: Path) -> Iterator[Path | None]:
    """A small tmpfs holding a directory and a file, remounted read-only; None where mounting is not allowed."""
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True).returncode:
        yield None
        return
    try:
        (mount / "existing_dir").mkdir()
        (mount / "existing_file").write_text("kept")
        subprocess.run(["mount", "-o", "remount,ro", str(mount)], check=True, capture_output=True)
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.fixture
def world(tmp_path: Path, small_corpus: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[World]:
    inputs = tmp_path / "in"
    (inputs / "adir").mkdir(parents=True)
    (inputs / "afile.toml").write_text("[train]\nsteps = 2\n")
    (inputs / "loop").symlink_to("loop")
    (inputs / "dangling").symlink_to(tmp_path / "nowhere")
    os.mkfifo(inputs / "fifo")
    for i, name in enumerate(("a.txt", "b.md", "c.txt")):
        (inputs / "src").mkdir(exist_ok=True)
        (inputs / "src" / name).write_text(f"document {i}: " + "words of text " * 40)
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    keep_work_from_starting(monkeypatch)
    with readonly_volume(tmp_path / "ro") as readonly:
        yield World(tmp_path, small_corpus, readonly)


# ---------------------------------------------------------------- the tests

def path_arguments(parser: argparse.ArgumentParser, command: str = "") -> Iterator[tuple[str, argparse.Action]]:
    """(command, action) of every argument of every command, subcommands included."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from path_arguments(sub, f"{command} {name}".strip())
        else:
            yield command, action


# names that say an argument is a path, whatever its type
PATH_NAMES = {"path", "dir", "root", "out", "html", "config", "workdir", "tokenizer", "include", "source",
              "cluster", "calibrate", "sweep", "resume"}


def test_every_path_argument_is_checked_and_fuzzed(tmp_path: Path) -> None:
    """A path argument is a PathArg (checked as it is read), and the fuzz drives every one of them."""
    arguments = list(path_arguments(cli.parser()))
    unchecked = [(c, a.dest) for c, a in arguments if not isinstance(a, PathArg) and (
        a.type is Path or a.dest in PATH_NAMES or a.dest.endswith(("_dir", "_dirs", "_path", "_file")))]
    assert not unchecked, f"path arguments not checked by keel.cli.pathargs: {unchecked}"
    checked = {(c, (a.option_strings or [a.dest])[0]) for c, a in arguments if isinstance(a, PathArg)}
    fuzzed = {slot.arg for slot in slots(World(tmp_path, tmp_path, None))}
    assert checked <= fuzzed, f"path arguments the fuzz does not drive: {sorted(checked - fuzzed)}"


def check_cases(world: World, kinds: set[str]) -> int:
    """Run the fuzz's cases of `kinds`; their number."""
    todo = [([a.replace("{}", path) for a in slot.argv], slot.named, f"{slot.arg} {kind} (seed {SEED})")
            for slot, kind, path in cases(world, SEED, kinds)]
    failures = run_cases(todo, world.root, world.corpus)
    assert not failures, f"{len(failures)} of {len(todo)} bad paths mishandled:\n" + "\n".join(failures[:40])
    return len(todo)


def test_bad_paths_are_one_line_exit_2_and_change_nothing(world: World) -> None:
    assert check_cases(world, set(BAD) - {"read-only file system"}) > 500


def test_outputs_on_a_read_only_volume_are_one_line(world: World) -> None:
    if world.readonly is None:
        pytest.skip("no file system can be mounted here to remount read-only (mounting needs root)")
    assert check_cases(world, {"read-only file system"}) > 10


UNREADABLE_SCRIPT = """
import json, sys
import pytest
from tests.unit.cli import test_bad_paths as t
todo, watched = json.loads(sys.argv[1]), sys.argv[2:]
with pytest.MonkeyPatch.context() as monkeypatch:
    t.keep_work_from_starting(monkeypatch)
    print(json.dumps(t.run_cases(todo, *map(t.Path, watched))))
"""


def test_unreadable_inputs_are_one_line(world: World) -> None:
    """A file or directory that cannot be read (mode 000): as root, whose capabilities read anything, the
    commands run in a root process without them (setpriv drops CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH)."""
    secret_file, secret_dir = world.root / "in" / "secret.toml", world.root / "in" / "secret"
    secret_file.write_text("[train]\nsteps = 2\n")
    secret_dir.mkdir()
    secret_file.chmod(0)
    secret_dir.chmod(0)
    todo = [([a.replace("{}", str(secret_dir if slot.kind == "in_dir" else secret_file) + slot.suffix)
              for a in slot.argv], slot.named, f"{slot.arg} unreadable")
            for slot in slots(world) if slot.kind.startswith("in_")]
    if os.geteuid() != 0:
        failures = run_cases(todo, world.root, world.corpus)
    else:
        if not shutil.which("setpriv"):
            pytest.skip("root reads any file; setpriv, which runs a root process without that power, is missing")
        done = subprocess.run(["setpriv", "--bounding-set=-dac_override,-dac_read_search", sys.executable, "-c",
                               UNREADABLE_SCRIPT, json.dumps(todo), str(world.root), str(world.corpus)],
                              capture_output=True, text=True, env=keel_env(), cwd=Path.cwd(), timeout=120)
        if done.returncode and "setpriv" in done.stderr:
            pytest.skip(f"cannot drop root's read capabilities here: {done.stderr.strip()}")
        assert done.returncode == 0, done.stderr
        failures = json.loads(done.stdout.splitlines()[-1])
    assert not failures, "\n".join(failures)


def test_an_empty_run_dir_is_refused_and_nothing_is_written(tmp_path: Path) -> None:
    """`keel train --run-dir ''`, as a real process: it is not the working directory, which stays as it was."""
    (tmp_path / "checkout").mkdir()
    (tmp_path / "checkout" / "keep.txt").write_text("mine")
    before = snapshot(tmp_path)
    result = run_keel(["train", "--run-dir", "", "train.steps=1"], cwd=tmp_path / "checkout", timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == ["keel: error: --run-dir is empty, which names no file; pass a directory "
                                          "(it is created when missing)"]
    assert result.stdout == "" and snapshot(tmp_path) == before
