"""Config sections declared by the modules that use them, not by the schema: a section of the schema marked with
`@takes_sections(PACKAGE)` (`[monitor]`, whose `[monitor.NAME]` are the experiment trackers') takes, besides
its own fields, one section per dataclass that a module of PACKAGE registers with `add_section`. Such a section
is a field like any other of the type `with_sections` makes: loaded, checked, written to config.toml, compared
on resume and documented as the schema's own sections are.

keel.config imports nothing above it: PACKAGE is a name, imported when the sections are wanted (each time, so
that a module added to it is found), the way Python's entry points name the modules of a plugin.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, TypeVar

from keel.core.registry import Registry

T = TypeVar("T")

# A section of the schema that takes registered sections → their registry (the modules of its package).
SECTIONS: dict[type, Registry[type]] = {}


def takes_sections(package: str, what: str) -> Callable[[type[T]], type[T]]:
    """Marks a section of the schema as taking the sections that the modules of `package` register (`what`:
    what one is called in an error)."""

    def mark(cls: type[T]) -> type[T]:
        SECTIONS[cls] = Registry(package, what)
        return cls

    return mark


def add_section(parent: type, name: str, section: type) -> None:
    """Registers the dataclass `section` as the section `name` of `parent` (`[parent.name]`); called by a
    module of `parent`'s package as it is imported. Every field of `section` is declared with `option`."""
    if parent not in SECTIONS:
        raise TypeError(f"{parent.__name__} takes no registered sections")
    if not dataclasses.is_dataclass(section):
        raise TypeError(f"the section {name!r} of {parent.__name__} must be a dataclass, not {section!r}")
    if not name.isidentifier() or name in {f.name for f in dataclasses.fields(parent)}:
        raise ValueError(f"{name!r} cannot name a section of {parent.__name__}: not an identifier, or one of "
                         f"its own fields")
    SECTIONS[parent].add(name, section)


def sections(parent: type) -> dict[str, type]:
    """name → dataclass of every section registered for `parent`, once every module of its package is
    imported; empty for a section of the schema that takes none."""
    registry = SECTIONS.get(parent)
    return registry.all() if registry is not None else {}


def with_sections(tp: Any) -> Any:
    """The type a config value of the schema's type `tp` is made of: for a section that takes registered
    sections, a subclass with one more field per section (default: the section's defaults); any other type
    as it is."""
    if tp not in SECTIONS:
        return tp
    return _extended(tp, tuple(sections(tp).items()))


@functools.cache
def _extended(parent: type, added: tuple[tuple[str, type], ...]) -> type:
    """One class per set of sections, so that configs made with the same sections compare equal."""
    if not added:
        return parent
    cls = dataclasses.make_dataclass(parent.__name__, [(name, section, dataclasses.field(default_factory=section))
                                                       for name, section in added], bases=(parent,))
    cls.__module__, cls.__qualname__, cls.__doc__ = parent.__module__, parent.__qualname__, parent.__doc__
    return cls
