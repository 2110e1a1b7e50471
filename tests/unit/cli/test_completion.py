"""`keel completion bash|zsh`, run by the shells themselves, and the help text of every argument."""

from __future__ import annotations

import argparse
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from keel.cli import main, parser
from keel.cli.completion import commands


def script(shell: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> Path:
    assert main(["completion", shell]) == 0
    path = tmp_path / f"keel.{shell}"
    path.write_text(capsys.readouterr().out)
    return path


def bash_completes(completion: Path, lines: list[list[str]], cwd: Path) -> list[list[str]]:
    """What bash's completion function offers for the last word of each command line."""
    calls = "\n".join(f"c {' '.join(shlex.quote(w) for w in line)}" for line in lines)
    program = (f"source {shlex.quote(str(completion))}\n"
               'c() { COMP_WORDS=("$@"); COMP_CWORD=$(($# - 1)); COMPREPLY=(); _keel; echo "${COMPREPLY[*]}"; }\n'
               f"{calls}\n")
    done = subprocess.run(["bash", "--norc", "--noprofile", "-c", program], cwd=cwd, capture_output=True, text=True,
                          check=True)
    assert done.stderr == ""
    return [sorted(line.split()) for line in done.stdout.splitlines()]


def test_bash_completes_commands_flags_values_and_paths(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    completion = script("bash", tmp_path, capsys)
    subprocess.run(["bash", "-n", str(completion)], check=True)
    registered = subprocess.run(["bash", "--norc", "--noprofile", "-c", f"source {shlex.quote(str(completion))} && "
                                 f"complete -p keel"], capture_output=True, text=True, check=True)
    assert registered.stdout.strip() == "complete -F _keel keel"
    (tmp_path / "runs" / "tiny").mkdir(parents=True)
    (tmp_path / "runs.txt").write_text("")
    cases = {
        ("keel", "tr"): ["train"],
        ("keel", "train", "--max"): ["--max-restarts"],
        ("keel", "train", "--n"): ["--nnodes", "--nproc"],
        ("keel", "train", "--config", "ti"): ["tiny", "tiny_moe"],
        ("keel", "plan", "--config", "mix"): ["mixtral_8x7b"],
        ("keel", "train", "--config", "=", "sm"): ["small"],  # --config=sm, as bash splits it
        ("keel", "train", "train.st"): ["train.steps="],
        ("keel", "train", "--nproc", "2", "optim.l"): ["optim.lr="],
        ("keel", "train", "--resume", "a"): ["auto"],
        ("keel", "train", "--run-dir", "run"): ["runs"],  # a directory, not the file beside it
        ("keel", "train", "--config", "run"): ["runs", "runs.txt"],
        ("keel", "ckpt", ""): ["export", "ls", "verify"],
        ("keel", "ckpt", "export", "--dt"): ["--dtype"],
        ("keel", "ckpt", "export", "--dtype", ""): ["bf16", "fp32"],
        ("keel", "eval", "--device", ""): ["auto", "cpu", "cuda"],
        ("keel", "status", "runs/"): ["runs/tiny"],
        ("keel", "quarantine", "runs/tiny", ""): [],  # the node's name: nothing to offer
        ("keel", "completion", ""): ["bash", "zsh"],
        ("keel", "data", "prepare", "--source", "runs/t"): ["runs/tiny"],
    }
    assert dict(zip(cases, bash_completes(completion, [list(k) for k in cases], tmp_path), strict=True)) == cases


def test_bash_completes_every_option_of_every_command(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    completion = script("bash", tmp_path, capsys)
    every = commands(parser())
    offered = bash_completes(completion, [[*c.words.split(), "-"] for c in every], tmp_path)
    for command, options in zip(every, offered, strict=True):
        assert options == sorted(command.options), command.words
        assert "--help" in options
    top = bash_completes(completion, [["keel", ""]], tmp_path)[0]
    assert top == sorted(parser()._subparsers._group_actions[0].choices)  # type: ignore[union-attr]


def test_zsh_script_parses_and_registers(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    if shutil.which("zsh") is None:
        pytest.skip("zsh is not installed")
    completion = script("zsh", tmp_path, capsys)
    subprocess.run(["zsh", "-n", str(completion)], check=True)
    registered = subprocess.run(
        ["zsh", "-fc", f"autoload -Uz compinit && compinit -u -D && source {shlex.quote(str(completion))} && "
                       f"print -r -- $_comps[keel]"], capture_output=True, text=True, check=True, cwd=tmp_path)
    assert registered.stdout.strip() == "_keel", registered.stderr


def walk(p: argparse.ArgumentParser, words: str = "keel") -> list[tuple[str, argparse.Action]]:
    """Every argument of every command, with the command it belongs to."""
    found = []
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, subparser in action.choices.items():
                found += walk(subparser, f"{words} {name}")
        else:
            found.append((words, action))
    return found


def test_every_argument_of_every_command_has_help() -> None:
    arguments = walk(parser())
    assert len(arguments) > 100 and any(not a.option_strings for _, a in arguments)
    missing = [f"{words} {a.option_strings or a.metavar or a.dest}" for words, a in arguments
               if not (a.help or "").strip()]
    assert missing == []


def test_zsh_function_offers_commands_flags_values_and_paths(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """The script's own _keel, run by zsh on command lines set in `words` and CURRENT as zsh's completion system
    sets them; zsh's builtins that show the candidates (compadd, _files) are replaced by ones that print them."""
    if shutil.which("zsh") is None:
        pytest.skip("zsh is not installed")
    completion = script("zsh", tmp_path, capsys)
    cases = {
        ("keel", "tr"): "train",
        ("keel", "train", "--max"): "--max-restarts",
        ("keel", "train", "--config", "ti"): "tiny",
        ("keel", "train", "--config=ti"): "tiny",
        ("keel", "ckpt", "export", "--dtype", ""): "bf16",
        ("keel", "train", "train.st"): "train.steps=",
        ("keel", "train", "--run-dir", "r"): "_files -/",
        ("keel", "report", "runs/a", ""): "_files -/",
        ("keel", "ckpt", "export", "--tokenizer", ""): "_files",
        ("keel", "completion", ""): "zsh",
    }
    calls = "\n".join(f"words=({' '.join(shlex.quote(w) for w in line)}); CURRENT={len(line)}; _keel; print -- ---"
                      for line in cases)
    program = ("compdef() { :; }\ncompset() { :; }\n_files() { print -r -- _files \"$@\"; }\n"
               "compadd() { local s=''; while [[ $1 != -- ]]; do [[ $1 == -S ]] && { s=$2; shift; }; shift; done; "
               "shift; print -rl -- ${^@}$s; }\n"
               f"source {shlex.quote(str(completion))}\n{calls}\n")
    done = subprocess.run(["zsh", "-fc", program], capture_output=True, text=True, check=True, cwd=tmp_path)
    assert done.stderr == ""
    offered = [block.split("\n") for block in done.stdout.strip("\n-").split("\n---\n")]
    assert len(offered) == len(cases)
    for line, candidates in zip(cases, offered, strict=True):
        assert cases[line] in candidates, (line, candidates)
    assert sorted(offered[1]) == sorted(next(c for c in commands(parser()) if c.words == "keel train").options)
