"""Fails when a function in src/keel is longer than `max-function-lines` of pyproject.toml's [tool.keel.lint].

A long function is allowed only when `[tool.keel.lint.long-functions]` names it ("path::qualified.name") with the
reason; an entry that no longer matches a long function fails too, so the list never outlives its reasons.
"""

from __future__ import annotations

import ast
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FunctionNode = ast.FunctionDef | ast.AsyncFunctionDef


def functions(tree: ast.AST, prefix: str = "") -> Iterator[tuple[str, FunctionNode]]:
    """Every function and method under `tree`, nested ones too, with its dotted name inside the module."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, FunctionNode | ast.ClassDef):
            name = f"{prefix}{node.name}"
            if isinstance(node, FunctionNode):
                yield name, node
            yield from functions(node, f"{name}.")
        else:
            yield from functions(node, prefix)


def long_functions(source_dir: Path, limit: int) -> dict[str, int]:
    """"path::name" -> lines, for each function whose def and body span more than `limit` lines."""
    found = {}
    for path in sorted(source_dir.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for name, node in functions(tree):
            lines = (node.end_lineno or node.lineno) - node.lineno + 1
            if lines > limit:
                found[f"{path.relative_to(ROOT).as_posix()}::{name}"] = lines
    return found


def main() -> int:
    settings = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["keel"]["lint"]
    limit: int = settings["max-function-lines"]
    allowed: dict[str, str] = settings.get("long-functions", {})
    found = long_functions(ROOT / "src" / "keel", limit)
    problems = [f"{where}: {lines} lines (> {limit}); split it, or allow it in pyproject.toml "
                f"[tool.keel.lint.long-functions] with the reason" for where, lines in found.items()
                if where not in allowed]
    problems += [f"{where}: allowed in [tool.keel.lint.long-functions] but not over {limit} lines (or gone); "
                 f"remove the entry" for where in allowed if where not in found]
    print("\n".join(problems) or f"function length: none over {limit} lines ({len(allowed)} allowed)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
