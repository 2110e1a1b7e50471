"""Things registered by name by the modules of one package (the guards, the experiment trackers, the parallel
degrees), found by importing every module of the package: a module added to it is found by its file alone, with no
list to edit."""

from __future__ import annotations

import importlib
import pkgutil
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """`what`s registered under a name by the modules of `package`, which register as they are imported."""

    def __init__(self, package: str, what: str) -> None:
        self.package, self.what = package, what
        self.entries: dict[str, T] = {}

    def add(self, name: str, entry: T) -> None:
        if name in self.entries and self.entries[name] != entry:
            raise ValueError(f"two {self.what}s are registered as {name!r}: {self.entries[name]!r} and {entry!r}")
        self.entries[name] = entry

    def all(self) -> dict[str, T]:
        """Every entry, by name in alphabetical order, once every module of the package is imported (a listing
        of its directories each time, so that nothing is cached between calls)."""
        for module in pkgutil.iter_modules(importlib.import_module(self.package).__path__, f"{self.package}."):
            importlib.import_module(module.name)
        return dict(sorted(self.entries.items()))
