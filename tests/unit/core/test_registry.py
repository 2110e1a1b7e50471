"""A registry finds what the modules of its package register by importing them all: a package of real module
files in a temporary directory on sys.path."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from keel.core.registry import Registry

PACKAGE = "keel_registry_demo"


def write_module(root: Path, name: str, source: str) -> None:
    (root / PACKAGE / f"{name}.py").write_text(source)
    importlib.invalidate_caches()


@pytest.fixture
def package(tmp_path: Path) -> Iterator[Path]:
    """An empty package `keel_registry_demo` whose __init__ holds the registry `THINGS`."""
    (tmp_path / PACKAGE).mkdir()
    (tmp_path / PACKAGE / "__init__.py").write_text(
        f"from keel.core.registry import Registry\nTHINGS = Registry({PACKAGE!r}, 'thing')\n")
    sys.path.insert(0, str(tmp_path))
    try:
        yield tmp_path
    finally:
        sys.path.remove(str(tmp_path))
        for name in [m for m in sys.modules if m == PACKAGE or m.startswith(f"{PACKAGE}.")]:
            del sys.modules[name]


def things() -> Registry:
    return importlib.import_module(PACKAGE).THINGS


def test_every_module_of_the_package_registers_and_a_new_file_is_found_by_the_next_listing(package: Path) -> None:
    write_module(package, "second", f"from {PACKAGE} import THINGS\nTHINGS.add('zeta', 2)\n")
    write_module(package, "first", f"from {PACKAGE} import THINGS\nTHINGS.add('alpha', 1)\n")
    assert things().entries == {}, "nothing registers before the package's modules are imported"
    assert list(things().all().items()) == [("alpha", 1), ("zeta", 2)]
    write_module(package, "third", f"from {PACKAGE} import THINGS\nTHINGS.add('mid', 3)\n")
    assert list(things().all()) == ["alpha", "mid", "zeta"]


def test_two_modules_registering_one_name_are_refused_with_both_named(package: Path) -> None:
    write_module(package, "one", f"from {PACKAGE} import THINGS\nTHINGS.add('same', 'from one')\n")
    write_module(package, "two", f"from {PACKAGE} import THINGS\nTHINGS.add('same', 'from two')\n")
    with pytest.raises(ValueError, match="two things are registered as 'same': 'from one' and 'from two'"):
        things().all()


def test_the_same_entry_registered_again_is_no_conflict() -> None:
    registry: Registry[int] = Registry("keel.guard", "guard")
    registry.add("x", 1)
    registry.add("x", 1)
    assert registry.entries == {"x": 1}
