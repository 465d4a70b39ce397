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
def reading(key: str, location: str | None = None, workers_read: bool = True, only_under: bool = False
            ) -> Iterator[None]:
    """Read an input inside the block: a refusal there becomes `Unreadable`, naming `key` (the setting or flag that
    gave the input) and the file (or `location`, the input's, when the refusal names none). A refusal is a
    PermissionError, or an object store's: gcsfs raises a bare OSError "Forbidden: PATH\\nMESSAGE" for HTTP 403
    (gcsfs.retry.validate_response). `workers_read`: the Ray workers read it too (the corpus's rows, the model's
    weights), so their user needs the access as well. `only_under`: the block may also write elsewhere (building an
    engine fills caches): a refusal naming a file outside `location` is left as it is."""
    try:
        yield
    except PermissionError as e:
        if only_under and location and e.filename is not None and not _within(str(e.filename), location):
            raise
        readers = "this user and by the Ray workers' user" if workers_read else "this user"
        raise Unreadable(f"{key}: cannot read {e.filename or location or 'it'} ({e.strerror or e}); make it "
                         f"readable by {readers}") from e
    except OSError as e:
        if e.errno is not None or not str(e).startswith("Forbidden: "):
            raise
        why = " ".join(str(e).split("\n")[1:]).strip() or "HTTP 403"
        readers = "this user's credentials and the Ray workers'" if workers_read else "this user's credentials"
        raise Unreadable(f"{key}: cannot read {location or str(e).splitlines()[0][11:]} (Forbidden: {why}); give "
                         f"{readers} read access to it (storage.objects.get and storage.objects.list)") from e


def _within(path: str, location: str) -> bool:
    if "://" not in location:
        path, location = os.path.abspath(path), os.path.abspath(location)
    return path == location or path.startswith(location.rstrip("/") + "/")
