"""Inputs pagefleet only reads (the corpus, the model, `generate --input`), and a refusal to read one told as such.

A PermissionError names a file and nothing else; the command line's own advice for one (make the location writable)
is right for the run directory and outputs, and wrong for a file the command only reads. Code that reads an input
does it inside `reading(key)`, which tells a refusal there as `Unreadable`: the setting, the file, and the fix.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager


class Unreadable(ValueError):
    """An input this user (or the Ray workers' user) may not read; the message names the setting, the file and the fix.
    A ValueError: an input error, found at the head and never retried, like a missing corpus."""


@contextmanager
def reading(key: str, workers_read: bool = True, under: str | None = None) -> Iterator[None]:
    """Read an input inside the block: a PermissionError there becomes `Unreadable`, naming `key` (the setting or flag
    that gave the input) and the file. `workers_read`: the Ray workers read it too (the corpus's rows, the model's
    weights), so their user needs the access as well. `under`: the input's location, for a block that may also
    write elsewhere (building an engine fills caches): a refusal naming a file outside it is left as it is."""
    try:
        yield
    except PermissionError as e:
        if under is not None and e.filename is not None and not _within(str(e.filename), under):
            raise
        readers = "this user and by the Ray workers' user" if workers_read else "this user"
        raise Unreadable(f"{key}: cannot read {e.filename or 'it'} ({e.strerror or e}); make it readable by "
                         f"{readers}") from e


def _within(path: str, location: str) -> bool:
    if "://" not in location:
        path, location = os.path.abspath(path), os.path.abspath(location)
    return path == location or path.startswith(location.rstrip("/") + "/")
