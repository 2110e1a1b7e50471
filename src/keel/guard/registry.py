"""keel's own guards, each registered by its module of keel.guard with `@guard(NAME)` on a class (or a function)
that makes the guard from the GuardConfig, or returns None where that config does without it. Every module of
the package is imported to find them, so that a guard is added by its file alone."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from keel.config import GuardConfig
from keel.core.guard import BuiltinGuard
from keel.core.registry import Registry

GuardMaker = Callable[[GuardConfig], BuiltinGuard | None]
M = TypeVar("M", bound=GuardMaker)

GUARDS: Registry[GuardMaker] = Registry("keel.guard", "guard")


def guard(name: str) -> Callable[[M], M]:
    """Registers a guard as `name`: the key of its state in the guards' state (a checkpoint's `guards.NAME`)."""

    def register(maker: M) -> M:
        GUARDS.add(name, maker)
        return maker

    return register


def build_guards(cfg: GuardConfig) -> dict[str, BuiltinGuard]:
    """The registered guards this config runs, by name in alphabetical order (the order they are asked in)."""
    made = {name: maker(cfg) for name, maker in GUARDS.all().items()}
    return {name: g for name, g in made.items() if g is not None}
