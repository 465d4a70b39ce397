"""Named crash points for crash-safety tests: `PAGEFLEET_CRASH_AT=name[:k]` SIGKILLs the head the k-th time
(default first) it reaches `name`. Unset (always, outside tests), a crash point is one dictionary lookup.

Points: planned, dispatched, output_tmp (a batch's outputs written to the temporary file, not yet renamed),
output_written, manifest_tmp (the new batches.jsonl written, not yet renamed), manifest_written; and in a slice's
process, slice_start (as it starts: the slice dies before loading anything; the head passes the variable on);
batch_file (planning writes a batch file: in the head, or in a Ray worker, which sees the variable when
the head started its Ray); window_planned (planning has written a window's batch files, before the next window).

`PAGEFLEET_DISK_FULL_AT=name[:k]` instead raises the OSError(ENOSPC) a full disk gives, there.
"""

from __future__ import annotations

import errno
import os
import signal

_seen: dict[str, int] = {}


def crash_point(name: str) -> None:
    if _reached("PAGEFLEET_CRASH_AT", name):
        os.kill(os.getpid(), signal.SIGKILL)
    if _reached("PAGEFLEET_DISK_FULL_AT", name):
        raise OSError(errno.ENOSPC, f"No space left on device (PAGEFLEET_DISK_FULL_AT={name})")


SLICE_POINTS = ("slice_start",)


def slice_environment() -> dict[str, str]:
    """The crash variable for a slice's processes when it names a slice's point (empty otherwise: always, outside
    tests)."""
    spec = os.environ.get("PAGEFLEET_CRASH_AT", "")
    return {"PAGEFLEET_CRASH_AT": spec} if spec.partition(":")[0] in SLICE_POINTS else {}


def _reached(variable: str, name: str) -> bool:
    spec = os.environ.get(variable)
    if not spec:
        return False
    target, _, nth = spec.partition(":")
    if target != name:
        return False
    key = f"{variable}={name}"
    _seen[key] = _seen.get(key, 0) + 1
    return _seen[key] == int(nth or 1)
