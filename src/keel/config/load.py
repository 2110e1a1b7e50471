"""Building a Config from TOML and KEY=VALUE overrides, with messages that name the field; writing it back as
TOML and documenting every option."""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import tomllib
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from keel.config.checks import check_consistency
from keel.config.hf import fill_from_hf, given_fields
from keel.config.schema import INT_MAX, Config, SourceConfig
from keel.config.sections import with_sections
from keel.errors import ConfigError
from keel.paths import check_input, shown


def _type_name(tp: Any) -> str:
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false",
            dict: "a table"}.get(tp, str(tp).replace("typing.", ""))


def _set_type(tp: Any) -> Any:
    """The type a value of an option must have: `int | None` (an option that may be left unset; TOML has no
    null, so a value given is always the other type) takes an int."""
    if isinstance(tp, types.UnionType):
        return next(t for t in typing.get_args(tp) if t is not type(None))
    return tp


def _check_value(path: str, value: Any, tp: Any, meta: typing.Mapping[str, Any]) -> Any:
    tp = _set_type(tp)
    origin = typing.get_origin(tp)
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(f"{path} = {value!r}: expected a list, each item {_type_name(item_tp)}")
        return [_check_value(f"{path}[{i}]", v, item_tp, {}) for i, v in enumerate(value)]
    if origin is dict:
        value_tp = typing.get_args(tp)[1]
        if not isinstance(value, dict):
            raise ConfigError(f"{path} = {value!r}: expected a table, each value {_type_name(value_tp)}")
        return {k: _check_value(f"{path}.{k}", v, value_tp, {}) for k, v in value.items()}
    ok = {bool: lambda v: isinstance(v, bool),
          int: lambda v: isinstance(v, int) and not isinstance(v, bool),
          float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
          str: lambda v: isinstance(v, str),
          dict: lambda v: isinstance(v, dict)}[tp]
    if not ok(value):
        raise ConfigError(f"{path} = {value!r}: expected {_type_name(tp)}")
    if tp is float:
        value = float(value)
        if not math.isfinite(value):
            raise ConfigError(f"{path} = {value!r}: expected a finite number")
    if tp is str:
        _check_text(path, value)
    upper = meta.get("le") if meta.get("le") is not None else INT_MAX if tp is int else None
    bounds = [(meta.get("ge"), ">=", lambda v, b: v >= b), (meta.get("gt"), ">", lambda v, b: v > b),
              (upper, "<=", lambda v, b: v <= b)]
    for bound, _, holds in bounds:
        if bound is not None and not holds(value, bound):
            allowed = " and ".join(f"{s} {b if isinstance(b, int) else f'{b:g}'}" for b, s, _ in bounds
                                   if b is not None)
            raise ConfigError(f"{path} = {value!r} is out of range: must be {allowed}")
    choices = meta.get("choices")
    if choices and value not in choices:
        raise ConfigError(f"{path} = {value!r}: expected one of {', '.join(choices)}")
    return value


def _check_text(path: str, value: str) -> None:
    """A string must be writable as UTF-8 (not so a command line's undecodable bytes) and free of NUL, which no
    path, URL or name may hold."""
    try:
        value.encode()
    except UnicodeEncodeError:
        raise ConfigError(f"{path} = {value!r}: not valid UTF-8 text; write it in UTF-8") from None
    if "\0" in value:
        raise ConfigError(f"{path} = {value!r}: a NUL character is not allowed in a string")


def _unknown_key(path: str, key: str, known: list[str]) -> ConfigError:
    close = difflib.get_close_matches(key, known, n=1)
    hint = f"; did you mean '{close[0]}'?" if close else f"; known keys: {', '.join(known)}"
    where = f"[{path}]" if path else "the top level"
    return ConfigError(f"unknown config key '{key}' in {where}{hint}")


def _table_type(tp: Any) -> type | None:
    """The value type of a `dict[str, SomeDataclass]` field (named tables such as [data.sources.NAME])."""
    if typing.get_origin(tp) is dict and dataclasses.is_dataclass(typing.get_args(tp)[1]):
        return typing.get_args(tp)[1]
    return None


def _build_tables(cls: type, value: Any, path: str) -> dict:
    if isinstance(value, list) and all(isinstance(v, str) for v in value) and cls is SourceConfig:
        value = {"main": {"paths": value}}  # a plain list of paths is one source
    if not isinstance(value, dict) or not value:
        raise ConfigError(f"{path} = {value!r}: expected named tables, e.g. [{path}.web]")
    return {name: _build(cls, v, f"{path}.{name}") for name, v in value.items()}


def _build(cls: type, data: Any, path: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{path or 'config'} = {data!r}: expected a table")
    cls = with_sections(cls)  # [monitor.NAME]: the sections registered by the modules above keel.config
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in data:
        if key not in fields:
            raise _unknown_key(path, key, list(fields))
    kwargs = {}
    for key, value in data.items():
        tp, sub = hints[key], f"{path}.{key}" if path else key
        item_tp = typing.get_args(tp)[0] if typing.get_origin(tp) is list else None
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            kwargs[key] = _build(tp, value, sub)
        elif (table_tp := _table_type(tp)) is not None:
            kwargs[key] = _build_tables(table_tp, value, sub)
        elif isinstance(item_tp, type) and dataclasses.is_dataclass(item_tp):
            if not isinstance(value, list):
                raise ConfigError(f"{sub} = {value!r}: expected an array of tables ([[{sub}]])")
            kwargs[key] = [_build(item_tp, v, f"{sub}[{i}]") for i, v in enumerate(value)]
        else:
            kwargs[key] = _check_value(sub, value, tp, fields[key].metadata)
    return cls(**kwargs)


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b=VALUE`: VALUE is read as a TOML value when it parses as one, else taken as a string."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {text!r}: expected KEY=VALUE, e.g. train.steps=50")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except ValueError:  # not TOML (TOMLDecodeError), or an integer of more digits than Python converts
        value = raw
    return key.strip().split("."), value


def _apply_override(data: dict, keys: list[str], value: Any, text: str) -> None:
    _apply_override_in(data, Config, keys, value, text, "")


def _apply_override_in(data: dict, cls: type, keys: list[str], value: Any, text: str, path: str) -> None:
    node = data
    for i, key in enumerate(keys):
        cls = with_sections(cls)
        fields = {f.name: f for f in dataclasses.fields(cls)}
        if key not in fields:
            raise _unknown_key(path, key, list(fields))
        tp = typing.get_type_hints(cls)[key]
        last = i == len(keys) - 1
        if last:
            # A string field takes the text as written, even when it reads as a number (989e12).
            node[key] = text.partition("=")[2] if tp is str and isinstance(value, (int, float)) else value
        elif isinstance(tp, type) and dataclasses.is_dataclass(tp):
            node = node.setdefault(key, {})
            cls, path = tp, f"{path}.{key}" if path else key
        elif (table_tp := _table_type(tp)) is not None and i + 2 < len(keys):
            # data.sources.web.weight=0.5: a named table; from the defaults when the config file has none
            tables = node.setdefault(key, {})
            if not isinstance(tables, dict):
                raise ConfigError(f"override {text!r}: '{'.'.join(keys[:i + 1])}' is a list here, not named tables")
            defaults = dataclasses.asdict(cls())[key]
            if not tables and keys[i + 1] in defaults:
                tables.update(defaults)
            node = tables.setdefault(keys[i + 1], {})
            _apply_override_in(node, table_tp, keys[i + 2:], value, text, f"{path}.{key}.{keys[i + 1]}")
            return
        else:
            raise ConfigError(f"override {text!r}: '{'.'.join(keys[:i + 1])}' is not a section")


def load_config(path: str | Path | None, overrides: Sequence[str] = ()) -> Config:
    data: dict = {}
    if path is not None:
        path = check_input(path, "config file", "file", "pass a TOML file such as configs/tiny.toml, or a shipped "
                           "config's name (tiny, small, llama3_8b, ...)", ConfigError)
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except UnicodeDecodeError as e:
            raise ConfigError(f"config file {shown(path)} is not UTF-8 text (byte {e.start}: {e.reason}); TOML files "
                              f"are UTF-8") from None
        except ValueError as e:  # TOMLDecodeError, or an integer of more digits than Python converts
            raise ConfigError(f"config file {shown(path)} is not valid TOML: {e}") from None
        except OSError as e:
            raise ConfigError(f"config file {shown(path)} cannot be read: {e.strerror or e}") from None
    in_file = given_fields([], data.get("model"))
    on_command_line: set[str] = set()
    for text in overrides:
        keys, value = parse_override(text)
        _apply_override(data, keys, value, text)
        if keys[0] == "model":
            on_command_line |= given_fields(keys[1:], value)
    fill_from_hf(data, in_file, on_command_line)
    cfg = _build(Config, data, "")
    if not cfg.name:
        cfg.name = path.stem if path is not None else "tiny"  # the built-in defaults are configs/tiny.toml
    check_consistency(cfg)
    return cfg


# ---------------------------------------------------------------- writing and documenting

def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        # JSON string escapes are valid TOML ones; TOML also forbids a raw DEL.
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {_toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot write {value!r} as TOML")


def to_toml(cfg: Config) -> str:
    tree = dataclasses.asdict(cfg)
    lines = [f"name = {_toml_value(tree.pop('name'))}"]
    callbacks = tree.pop("callbacks")

    def write(section: str, values: dict) -> None:  # a nested dataclass is a [section.sub] table
        nested = {k: v for k, v in values.items() if isinstance(v, dict)}
        lines.extend(["", f"[{section}]"] + [f"{k} = {_toml_value(v)}" if v is not None else f"# {k}: unset"
                                             for k, v in values.items() if k not in nested])
        for key, sub in nested.items():
            write(f"{section}.{key}", sub)

    for section, values in tree.items():
        write(section, values)
    for cb in callbacks:
        lines += ["", "[[callbacks]]"] + [f"{k} = {_toml_value(v)}" for k, v in cb.items()]
    return "\n".join(lines) + "\n"


def reference() -> list[tuple[str, str, str, str]]:
    """(key, type, default, help) for every option, for `keel config --reference` and docs/configuration.md."""
    rows = []

    def walk(cls: type, prefix: str) -> None:
        cls = with_sections(cls)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            tp = hints[f.name]
            if isinstance(tp, type) and dataclasses.is_dataclass(tp):
                walk(tp, f"{prefix}{f.name}.")
                continue
            if typing.get_origin(tp) is list and dataclasses.is_dataclass(typing.get_args(tp)[0]):
                walk(typing.get_args(tp)[0], f"{prefix}{f.name}[].")
                continue
            if (table_tp := _table_type(tp)) is not None:
                walk(table_tp, f"{prefix}{f.name}.NAME.")
                continue
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            choices = f.metadata.get("choices")
            help_text = f.metadata.get("help", "") + (f"; one of: {', '.join(choices)}" if choices else "")
            tp = _set_type(tp)
            type_name = tp.__name__ if isinstance(tp, type) else str(tp)
            rows.append((prefix + f.name, type_name, "unset" if default is None else _toml_value(default), help_text))

    walk(Config, "")
    return rows
