"""Opt-in traces: `PAGEFLEET_TRACE=transfers` turns on one dedicated logger and nothing else.

A trace never raises a global log level: each has its own logger (`pagefleet.<trace>`), set to INFO only when
its name is in `PAGEFLEET_TRACE` (comma-separated). No JAX here: the command line checks the variable on the
head before any work starts.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping

TRACE_ENV = "PAGEFLEET_TRACE"
TRACES = ("transfers",)
"""Every trace `PAGEFLEET_TRACE` may name: `transfers` logs each device call's bytes by category and direction."""


def traces(env: Mapping[str, str] = os.environ) -> frozenset[str]:
    """The traces `PAGEFLEET_TRACE` turns on (empty when unset); a name that is not a trace is a ValueError
    whose one line names the valid ones."""
    raw = env.get(TRACE_ENV, "")
    names = frozenset(n.strip() for n in raw.split(",") if n.strip())
    unknown = sorted(names - set(TRACES))
    if unknown:
        raise ValueError(f"{TRACE_ENV}={raw!r} names no trace {', '.join(map(repr, unknown))}; valid: "
                         f"{', '.join(TRACES)} (comma-separated), or leave it unset")
    return names


def trace_logger(name: str) -> logging.Logger | None:
    """The logger of trace `name` (`pagefleet.<name>`), at INFO, when `PAGEFLEET_TRACE` turns it on; else None.

    Its records go to the handlers already configured above it (a test's caplog, an application's logging);
    where there are none, to stderr through a handler of its own (once), so the trace shows without
    `logging.basicConfig` and without lowering any other logger's level."""
    if name not in TRACES:
        raise ValueError(f"{name!r} is not a trace; valid: {', '.join(TRACES)}")
    if name not in traces():
        return None
    logger = logging.getLogger(f"pagefleet.{name}")
    logger.setLevel(logging.INFO)
    if not logger.hasHandlers():
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
        logger.addHandler(handler)
    return logger
