"""A module file added to one of keel's packages for the length of a test, as a new module of the package
would be: the file is written to a directory of its own that joins the package's path, so that the
installed package is left alone."""

from __future__ import annotations

import contextlib
import importlib
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

from keel.core.registry import Registry


@contextlib.contextmanager
def added_module(package: str, name: str, source: str, where: Path, *registries: Registry) -> Iterator[str]:
    """`source` as the file of the module PACKAGE.NAME, under `where` (made if missing); yields the module's full
    name. On leaving, the package's path, the entries of `registries` (those the package's modules register in)
    and the imported modules are as they were."""
    pkg = importlib.import_module(package)
    for registry in registries:
        registry.all()  # the package's own modules register first: the entries restored are theirs
    kept_path, kept_entries = list(pkg.__path__), [dict(registry.entries) for registry in registries]
    where.mkdir(parents=True, exist_ok=True)
    (where / f"{name}.py").write_text(textwrap.dedent(source))
    pkg.__path__.append(str(where))
    importlib.invalidate_caches()
    try:
        yield f"{package}.{name}"
    finally:
        pkg.__path__[:] = kept_path
        for registry, entries in zip(registries, kept_entries, strict=True):
            registry.entries = entries
        sys.modules.pop(f"{package}.{name}", None)
        if hasattr(pkg, name):
            delattr(pkg, name)
