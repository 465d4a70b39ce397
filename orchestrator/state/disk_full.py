"""A full disk under the run directory, as one line that names the file and the recovery, wherever it happens:
in the head's own writes or in a Ray worker's (planning's batch files), whose error arrives wrapped."""

from __future__ import annotations

import errno
from pathlib import Path

FULL = (errno.ENOSPC, errno.EDQUOT)


class DiskFull(OSError):
    """The disk (or quota) holding the run directory is full; the message names the file and the recovery."""


def disk_full(e: BaseException, where: str | Path) -> DiskFull | None:
    """A DiskFull for an out-of-space error `e` or one it wraps (a Ray task's error carries the
    worker's OSError as its cause), None for any other error."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in FULL:
            return DiskFull(e.errno, f"out of disk space writing {e.filename or where} ({e.strerror}); free space "
                            "there and rerun the same command: the run resumes where it stopped, losing nothing written")
        e = getattr(e, "cause", None) or e.__cause__ or e.__context__
    return None
