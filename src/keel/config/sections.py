"""Config sections and options declared by the modules that use them, not by the schema: a section of the schema
marked with `@takes_sections(PACKAGE)` takes, besides its own fields, one section per dataclass that a module of
PACKAGE registers with `add_section` (`[monitor]`, whose `[monitor.NAME]` are the experiment trackers') and one
option per `add_option` (`[parallel]`, whose registered degrees are options of it). Either is a field like any
other of the type `with_sections` makes: loaded, checked, written to config.toml, compared on resume and
documented as the schema's own fields are; an option may bring its check across the config's fields, which
`keel.config.checks` runs with the schema's own.

keel.config imports nothing above it: PACKAGE is a name, imported when the sections are wanted (each time, so
that a module added to it is found), the way Python's entry points name the modules of a plugin.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from keel.core.registry import Registry

T = TypeVar("T")



@dataclass(frozen=True)
class Option:
    """An option registered for a section: its type, its field (declared with `keel.config.option`) and its check
    of the whole config, run once the config is built (None: it has none)."""

    type: type
    field: Any
    check: Callable[[Any], None] | None = None


# A section of the schema that takes registered fields → their registry (the modules of its package): a
# dataclass per registered section, an Option per registered option.
SECTIONS: dict[type, Registry[type | Option]] = {}


def takes_sections(package: str, what: str) -> Callable[[type[T]], type[T]]:
    """Marks a section of the schema as taking the sections and options that the modules of `package` register
    (`what`: what one is called in an error)."""

    def mark(cls: type[T]) -> type[T]:
        SECTIONS[cls] = Registry(package, what)
        return cls

    return mark


def add_section(parent: type, name: str, section: type) -> None:
    """Registers the dataclass `section` as the section `name` of `parent` (`[parent.name]`); called by a
    module of `parent`'s package as it is imported. Every field of `section` is declared with `option`."""
    if not dataclasses.is_dataclass(section):
        raise TypeError(f"the section {name!r} of {parent.__name__} must be a dataclass, not {section!r}")
    _registry(parent, name, "section").add(name, section)


def add_option(parent: type, name: str, tp: type, declared: Any, check: Callable[[Any], None] | None = None) -> None:
    """Registers the option `name` of type `tp` for `parent` (`parent.name`), declared with `option`; `check`,
    if given, is called with every config built, after its fields are checked."""
    if not isinstance(declared, dataclasses.Field):
        raise TypeError(f"the option {name!r} of {parent.__name__} must be declared with keel.config.option")
    _registry(parent, name, "option").add(name, Option(tp, declared, check))


def _registry(parent: type, name: str, what: str) -> Registry[type | Option]:
    if parent not in SECTIONS:
        raise TypeError(f"{parent.__name__} takes no registered sections")
    if not name.isidentifier() or name in {f.name for f in dataclasses.fields(parent)}:
        raise ValueError(f"{name!r} cannot name a {what} of {parent.__name__}: not an identifier, or one of "
                         f"its own fields")
    return SECTIONS[parent]


def sections(parent: type) -> dict[str, type | Option]:
    """name → dataclass (a section) or Option of every field registered for `parent`, once every module of its
    package is imported; empty for a section of the schema that takes none."""
    registry = SECTIONS.get(parent)
    return registry.all() if registry is not None else {}


def registered_checks() -> list[Callable[[Any], None]]:
    """The checks of every registered option, by section of the schema, then by the option's name."""
    return [entry.check for parent in SECTIONS for entry in sections(parent).values()
            if isinstance(entry, Option) and entry.check is not None]


def with_sections(tp: Any) -> Any:
    """The type a config value of the schema's type `tp` is made of: for a section that takes registered
    fields, a subclass with one more field per registered section (default: the section's defaults) or option;
    any other type as it is."""
    if tp not in SECTIONS:
        return tp
    return _extended(tp, tuple(sections(tp).items()))


@functools.cache
def _extended(parent: type, added: tuple[tuple[str, type | Option], ...]) -> type:
    """One class per set of registered fields, so that configs made with the same fields compare equal."""
    if not added:
        return parent
    cls = dataclasses.make_dataclass(parent.__name__, [_field(name, entry) for name, entry in added], bases=(parent,))
    cls.__module__, cls.__qualname__, cls.__doc__ = parent.__module__, parent.__qualname__, parent.__doc__
    return cls


def _field(name: str, entry: type | Option) -> tuple[str, type, Any]:
    if isinstance(entry, Option):  # a copy: a class made binds the field it is given
        return name, entry.type, copy.copy(entry.field)
    return name, entry, dataclasses.field(default_factory=entry)
