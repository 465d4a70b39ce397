"""Which surface the caller came through (the command line, Python, HTTP), so that an error names a config key
the way that caller sets it: `--model.path=DIR` on the command line, `model={"path": DIR}` to a Python caller
(`pagefleet.load_config` and `pagefleet.run`), `"model": {"path": DIR}` in an HTTP body.

A message states the fact once with `setting(key, value)`; the surface in effect when it is raised renders it.
The command line is the default; `pagefleet.api` and the service enter theirs with `surface(...)`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Literal

Surface = Literal["cli", "python", "http"]

_CURRENT: ContextVar[Surface] = ContextVar("pagefleet_surface", default="cli")


@contextmanager
def surface(name: Surface) -> Iterator[None]:
    """Errors raised inside name settings as `name`'s callers write them."""
    token = _CURRENT.set(name)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def current() -> Surface:
    return _CURRENT.get()


def setting(key: str, value: str) -> str:
    """How the current caller sets the dotted config `key` to `value` (a placeholder such as DIR, or a value)."""
    where = _CURRENT.get()
    if where == "cli":
        return f"--{key}={value}"
    head, *rest = key.split(".")
    if where == "python":
        return f"{head}={value}" if not rest else f'{head}={{"{".".join(rest)}": {value}}}'
    return f'"{head}": {value}' if not rest else f'"{head}": {{"{".".join(rest)}": {value}}}'


def overrides_hint() -> str:
    """How the current caller overrides config keys in general."""
    where = _CURRENT.get()
    if where == "cli":
        return "overrides are --section.key=value"
    if where == "python":
        return 'overrides are keyword arguments, section={"key": value} or **{"section.key": value}'
    return "the body is a mapping of sections, {\"section\": {\"key\": value}}"
