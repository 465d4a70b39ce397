"""Named crash points for crash-safety tests: `PAGEFLEET_CRASH_AT=name[:k]` SIGKILLs the head the k-th time
(default first) it reaches `name`. Unset (always, outside tests), a crash point is one dictionary lookup.

Points: planned, dispatched, output_tmp (a batch's outputs written to the temporary file, not yet renamed),
output_written, manifest_tmp (the new batches.jsonl written, not yet renamed), manifest_written.
"""

from __future__ import annotations

import os
import signal

_seen: dict[str, int] = {}


def crash_point(name: str) -> None:
    spec = os.environ.get("PAGEFLEET_CRASH_AT")
    if not spec:
        return
    target, _, nth = spec.partition(":")
    if target != name:
        return
    _seen[name] = _seen.get(name, 0) + 1
    if _seen[name] == int(nth or 1):
        os.kill(os.getpid(), signal.SIGKILL)
