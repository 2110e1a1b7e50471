"""The configured callbacks (`[[callbacks]]`), imported and checked."""

from __future__ import annotations

import importlib
import inspect

from keel.config import CallbackSpec
from keel.core.callbacks import Callback
from keel.errors import ConfigError


def load_callbacks(specs: list[CallbackSpec]) -> list[Callback]:
    """The callbacks `specs` name, made."""
    callbacks = []
    for i, spec in enumerate(specs):
        cls = callback_class(spec, i)
        try:
            callbacks.append(cls(**spec.args))
        except TypeError as e:
            raise ConfigError(f"callbacks[{i}].args = {spec.args!r} do not fit {spec.path}: {e}") from None
    return callbacks


def callback_class(spec: CallbackSpec, i: int) -> type:
    """The class `callbacks[i].path` names, imported; the launcher checks every one before a worker starts."""
    module_name, _, attr = spec.path.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except Exception as e:  # the user's module: whatever its import raises is a fault of the config's path
        raise ConfigError(f"callbacks[{i}].path = {spec.path!r} cannot be imported: {type(e).__name__}: "
                          f"{(str(e).strip().splitlines() or [''])[0]}") from None
    if not callable(cls):
        raise ConfigError(f"callbacks[{i}].path = {spec.path!r} names a {type(cls).__name__}, not a class")
    return cls


def check_callbacks(specs: list[CallbackSpec]) -> None:
    """Every callback imports and its args fit its class, without making one (its __init__ may start work)."""
    for i, spec in enumerate(specs):
        cls = callback_class(spec, i)
        try:
            inspect.signature(cls).bind(**spec.args)
        except TypeError as e:
            raise ConfigError(f"callbacks[{i}].args = {spec.args!r} do not fit {spec.path}: {e}") from None
        except ValueError:  # no signature to read (a builtin): the call itself will tell
            pass
