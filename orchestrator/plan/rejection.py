"""Why a row cannot run (`Rejection`: its reason, as rejected.jsonl names it, and one line saying why), and the
checks of a row's values every part of planning words the same way."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class Rejection:
    reason: str
    detail: str


def a_type(value: object) -> str:
    """The value's Python type with its article: "an int", "a dict"."""
    name = type(value).__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def text_value(value: Any, what: str) -> str | Rejection:
    """`value` as a string (UTF-8 bytes, as a parquet binary column holds them, decoded), or why it is not one."""
    if isinstance(value, bytes):
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError as e:
            return Rejection("undecodable", f"{what} is not UTF-8: {e.reason} at byte {e.start}")
    if not isinstance(value, str):
        return Rejection("wrong_type", f"{what} is {a_type(value)}, not a string")
    return value
