"""Strict config types: a value of the wrong type is refused with one line naming its key, never converted.

draccus decodes a field by converting what it is given: `str([1, 2])` for a string field, `int(True)` for an
integer, `float("0.5")` for a number. Those conversions turn mistakes (and hostile input) into silently wrong
configs: a list in `sampling.stop` becomes the stop string "[1, 2]". So the raw values, as draccus will read
them (the YAML file, and each `--key=value` override read as YAML), are checked against the dataclass field
types first:

- a string field takes a string only; an integer field an integer only (not a bool, not a numeric string);
- a number field an integer or a finite float (also a plain decimal such as `1e-3`, which YAML 1.1 reads as
  text), never a bool, NaN or infinity; a bool field true or false only;
- lists, mappings and `X | None` are checked element by element; unknown keys are left to draccus, which
  refuses them with its own message.
"""

from __future__ import annotations

import dataclasses
import math
import re
import reprlib
import types
import typing
from pathlib import Path
from typing import Any, Literal

from orchestrator.config_errors import KEYS_DOC, ConfigError

# What YAML 1.2 reads as a float (PyYAML, which follows YAML 1.1, reads `1e-3` as a string).
_DECIMAL = re.compile(r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?")
_SHOW = reprlib.Repr()  # bounded: a value echoed in a message is a glimpse, however large it is
_SHOW.maxstring, _SHOW.maxother, _SHOW.maxlist, _SHOW.maxdict, _SHOW.maxlevel = 60, 60, 4, 4, 2


def check_config_types(cls: type, config_path: str | Path | None, overrides: list[str] | tuple[str, ...]) -> None:
    """Refuse a config file or override whose value has the wrong type for its key (ConfigError, one line)."""
    import draccus.cfgparsing

    if config_path is not None:
        with open(config_path, encoding="utf-8") as f:
            data = draccus.cfgparsing.load_config(f, file=str(config_path))
        if isinstance(data, dict):
            check_types(data, cls, f"{config_path}: ")
    for key, raw in _override_items(overrides):
        value = draccus.cfgparsing.parse_string(raw)
        if isinstance(value, str) and value.startswith("include"):
            continue  # draccus's `include FILE`: the file's content is decoded like a config section
        expected = _type_at(cls, key.split("."))
        if expected is not None:  # the value as YAML: `--name=0x10` reads as 16, so quote text ('"0x10"')
            _check(value, expected, key, f"--{key}={raw}: ")


def check_types(data: dict[str, Any], cls: type, where: str = "", prefix: str = "") -> None:
    """Check a raw config mapping against dataclass `cls`; `where` prefixes the message (a file name)."""
    hints = typing.get_type_hints(cls)
    for name, value in data.items():
        if not isinstance(name, str) or name not in hints:
            continue  # draccus names the unknown key
        _check(value, hints[name], f"{prefix}{name}", where)


def _check(value: Any, expected: Any, key: str, where: str) -> None:
    if dataclasses.is_dataclass(expected):
        if isinstance(value, dict):
            check_types(value, expected, where, f"{key}.")
        elif value is not None:
            raise ConfigError(f"{where}{key} must be a mapping of its keys, got {_kind(value)} ({_SHOW.repr(value)}) "
                              f"(keys in {KEYS_DOC})")
        return
    problem = _mismatch(value, expected)
    if problem:
        raise ConfigError(f"{where}{key} must be {problem}, got {_kind(value)} ({_SHOW.repr(value)}) (keys in {KEYS_DOC})")
    origin, args = typing.get_origin(expected), typing.get_args(expected)
    if origin is list:
        for i, item in enumerate(value):
            _check(item, args[0], f"{key}[{i}]", where)
    elif origin is dict:
        for k, item in value.items():
            _check(k, args[0], f"{key} key {k!r}", where)
            _check(item, args[1], f"{key}.{k}", where)
    elif origin in (typing.Union, types.UnionType) and value is not None:
        chosen = [a for a in args if a is not type(None) and not _mismatch(value, a)]
        if chosen and typing.get_origin(chosen[0]) in (list, dict):
            _check(value, chosen[0], key, where)


def _mismatch(value: Any, expected: Any) -> str | None:
    """What `expected` wants, in words, when `value` is not one (containers: only the outer type is checked)."""
    origin, args = typing.get_origin(expected), typing.get_args(expected)
    if expected is Any:
        return None
    if origin in (typing.Union, types.UnionType):
        wants = [_mismatch(value, a) for a in args]
        return None if any(w is None for w in wants) else " or ".join(w for w in wants if w)
    if expected is type(None):
        return None if value is None else "null"
    if origin is Literal:
        return None if any(value == a and type(value) is type(a) for a in args) else \
            "one of " + ", ".join(repr(a) for a in args)
    if origin is list:
        return None if isinstance(value, list) else "a list"
    if origin is dict:
        return None if isinstance(value, dict) else "a mapping"
    if expected is str:
        return None if isinstance(value, str) else "a string"
    if expected is bool:
        return None if isinstance(value, bool) else "true or false"
    if expected is int:
        return None if isinstance(value, int) and not isinstance(value, bool) else "an integer"
    if expected is float:
        if isinstance(value, str) and _DECIMAL.fullmatch(value):
            return None
        ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        return None if ok else "a finite number"
    if dataclasses.is_dataclass(expected):
        return None if isinstance(value, dict) or value is None else "a mapping of its keys"
    return None


def _type_at(cls: type, path: list[str]) -> Any:
    """The declared type at a dotted key (`cluster.mesh.model` reaches into a mapping), None if unknown."""
    expected: Any = cls
    for part in path:
        if dataclasses.is_dataclass(expected):
            expected = typing.get_type_hints(expected).get(part)
        elif typing.get_origin(expected) is dict:
            expected = typing.get_args(expected)[1]
        else:
            return None
        if expected is None:
            return None
    return expected


def _override_items(overrides: list[str] | tuple[str, ...]) -> list[tuple[str, str]]:
    """(key, raw value) of `--key=value` and `--key value` overrides (what argparse will read)."""
    items, args = [], list(overrides)
    for i, arg in enumerate(args):
        if not arg.startswith("--"):
            continue
        key, sep, raw = arg[2:].partition("=")
        if not sep:
            if i + 1 >= len(args) or args[i + 1].startswith("--"):
                continue
            raw = args[i + 1]
        items.append((key, raw))
    return items


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a bool"
    return {str: "a string", int: "an integer", float: "a number", list: "a list", dict: "a mapping"}.get(
        type(value), f"a {type(value).__name__}")
