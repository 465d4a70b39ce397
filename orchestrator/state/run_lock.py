"""The lock of a run directory, of the kind its storage needs: `flock` on a local directory (lock.py), an object
with generation preconditions on an object store (object_lock.py)."""

from __future__ import annotations

from pathlib import Path

from orchestrator.state.lock import RunLock
from orchestrator.state.object_lock import ObjectRunLock
from orchestrator.storage import storage


def run_lock(run_dir: str | Path, stale_after_s: float = 60.0) -> RunLock | ObjectRunLock:
    """The lock for `run_dir`; an object store's is stale after `stale_after_s` without a refresh."""
    if storage.is_object_store(run_dir):
        return ObjectRunLock(str(run_dir), stale_after_s=stale_after_s, refresh_s=stale_after_s / 6)
    return RunLock(run_dir)
