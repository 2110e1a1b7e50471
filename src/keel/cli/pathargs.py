"""Path arguments: every path a command takes is checked (keel.paths) while its command line is read, so a bad
one is refused before the command reads, writes or prints anything."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from keel.paths import check_input, check_name, check_writable_dir, check_writable_file

# (text as given, what it is called in a message) -> the value the command gets
Check = Callable[[str, str], Any]
C = TypeVar("C", bound=Callable[..., Any])
SHIPPED = Path(__file__).resolve().parent.parent / "configs"  # keel/configs, installed with the package
CONFIG_VALID = ("pass a TOML file such as configs/tiny.toml, or a shipped config's name (tiny, small, llama3_8b, "
                "...)")
CHECKPOINT_VALID = "pass a run directory, its checkpoints directory, a checkpoints/step-NNNNNN directory or a URL"


class PathArg(argparse.Action):
    """An argument that names a path: `check` refuses a bad one with a KeelError as it is parsed. `append`:
    repeatable, the values collected in a list."""

    def __init__(self, option_strings: Sequence[str], dest: str, check: Check, append: bool = False,
                 **kwargs: Any) -> None:
        super().__init__(option_strings, dest, **kwargs)
        self.check, self.append = check, append

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: str | Sequence[Any] | None, option_string: str | None = None) -> None:
        if values is self.default:  # an optional positional left out: its default is not the user's path
            setattr(namespace, self.dest, values)
            return
        what = option_string or (self.metavar if isinstance(self.metavar, str) else self.dest.upper())
        checked = [self.check(v, what) for v in values] if isinstance(values, list) else self.check(str(values), what)
        if self.append:
            checked = [*(getattr(namespace, self.dest) or []), checked]
        setattr(namespace, self.dest, checked)


def completing(paths: str, check: C, words: tuple[str, ...] = ()) -> C:
    """`check`, marked with what a shell completes for its argument (keel.cli.completion): `paths` "dir",
    "file" or "config" (a file or a shipped config's name), and fixed `words`."""
    setattr(check, "completes", (paths, words))  # noqa: B010 (a function's attribute, which mypy does not know)
    return check


def completes(check: Check) -> tuple[str, tuple[str, ...]]:
    """What a shell completes for an argument checked by `check`: `completing`'s mark, else any path."""
    marked: tuple[str, tuple[str, ...]] = getattr(check, "completes", ("file", ()))
    return marked


def reads(kind: str, valid: str, as_text: bool = False) -> Check:
    """An input: an existing file (`kind` "file"), directory ("dir") or either ("any") that can be opened; the
    command gets it as a Path, or `as_text`."""
    def check(text: str, what: str) -> Path | str:
        path = check_input(text, what, kind, valid)
        return text if as_text else path
    return completing("dir" if kind == "dir" else "file", check)


def writes_dir(text: str, what: str) -> Path:
    """An output directory: one that can be written in, or created."""
    return check_writable_dir(text, what)


def writes_file(text: str, what: str) -> Path:
    """An output file: one that can be replaced, or created."""
    return check_writable_file(text, what)


def config_file(text: str, what: str) -> Path:
    """--config: a TOML file, or the name of a shipped config (tiny, small, ...)."""
    check_name(text, what, CONFIG_VALID)
    given = Path(text)
    if given.parent == Path(".") and not os.path.lexists(given) and (SHIPPED / f"{given.name.removesuffix('.toml')}"
                                                                      f".toml").is_file():
        return given
    return check_input(text, what, "file", CONFIG_VALID)


def is_url(text: str) -> bool:
    return "://" in text and not text.startswith("file://")


def checkpoints_at(valid: str = CHECKPOINT_VALID) -> Check:
    """A place that holds checkpoints: a local directory, or a URL (fsspec) that only reading it can check."""
    def check(text: str, what: str) -> str:
        if not is_url(text):
            check_input(text.removeprefix("file://"), what, "dir", valid)
        return text
    return completing("dir", check)


def resume(text: str, what: str) -> str:
    """--resume: auto, never, or the checkpoint to load."""
    if text in ("auto", "never"):
        return text
    return checkpoints_at("pass a checkpoints/step-NNNNNN directory or URL, auto or never")(text, what)


def source(text: str, what: str) -> str:
    """--source: a file, a directory, a glob, a URL or Hugging Face dataset, or stdlib."""
    from keel.data.remote import is_remote
    from keel.data.sources import BUILTIN_STDLIB

    valid = f"pass files, directories, globs, URLs or {BUILTIN_STDLIB}"
    check_name(text, what, valid)
    if text == BUILTIN_STDLIB or is_remote(text) or (any(c in text for c in "*?[") and not os.path.lexists(text)):
        return text  # resolved by keel.data.sources, which says in one line when there is nothing to read
    check_input(text.removeprefix("file://"), what, "any", valid)
    return text


completing("dir", writes_dir)
completing("config", config_file)
completing("dir", resume, ("auto", "never"))
TOKENIZER = reads("any", "pass a tokenizer.json or the prepared corpus directory holding it")
