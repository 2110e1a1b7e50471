"""Every `pip install` hint keel prints names the distribution users install (pyproject's project name) and one
of its extras: a hint read off an error message must work when pasted."""

from __future__ import annotations

import ast
import re
import tomllib
from collections.abc import Iterator
from pathlib import Path

from keel.monitor.tracking.registry import BACKENDS
from tests.conftest import REPO

HINT = re.compile(r"pip install\s+'?(?P<dist>[A-Za-z0-9_.-]+)(?:\[(?P<extra>\{[^}]*\}|[^\]]*)\])?")
# The extras that an f-string's placeholder stands for, by the placeholder's source: a tracker's name, where
# keel-pretrain has an extra of that name (elsewhere the hint names the tracker's own client package).
PLACEHOLDERS = {"name": set(BACKENDS.all()) & set(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
                                               ["optional-dependencies"])}


def text_of(node: ast.Constant | ast.JoinedStr) -> str:
    """A string literal's text (implicit concatenations are one node), an f-string's with `{SOURCE}` placeholders."""
    if isinstance(node, ast.Constant):
        return str(node.value)
    return "".join("{" + ast.unparse(part.value) + "}" if isinstance(part, ast.FormattedValue) else str(part.value)
                   for part in node.values if isinstance(part, ast.FormattedValue | ast.Constant))


def hints(root: Path) -> Iterator[tuple[str, str]]:
    """(where, hint) for every `pip install` in a string of the package's code."""
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        parts = {id(part) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for part in node.values}
        for node in ast.walk(tree):
            is_string = isinstance(node, ast.JoinedStr) or (isinstance(node, ast.Constant)
                                                             and isinstance(node.value, str))
            if is_string and id(node) not in parts:  # an f-string's pieces are read as the whole f-string
                for match in HINT.finditer(text_of(node)):  # type: ignore[arg-type]
                    yield f"{path.relative_to(REPO)}:{node.lineno}", match.group(0)


def test_every_install_hint_names_the_distribution_and_an_extra_it_has() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = set(project["optional-dependencies"])
    found = list(hints(REPO / "src" / "keel"))
    assert len(found) >= 10, found  # the scan finds the hints (the three of torchft among them)
    wrong = []
    for where, hint in found:
        match = HINT.match(hint)
        assert match is not None
        named = match.group("extra") or ""
        wanted = PLACEHOLDERS.get(named[1:-1], set()) if named.startswith("{") else {named}
        quoted = hint.startswith("pip install '")  # a shell (zsh) takes an unquoted [EXTRA] as a pattern
        if match.group("dist") != project["name"] or not wanted or not wanted <= extras or not quoted:
            wrong.append(f"{where}: {hint}")
    assert wrong == [], f"expected pip install '{project['name']}[EXTRA]' with EXTRA one of {sorted(extras)}"
