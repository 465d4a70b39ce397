"""A full disk is one line wherever it happens, also when a Ray worker's OSError arrives wrapped."""

from __future__ import annotations

import errno

import ray.exceptions

from orchestrator.state.disk_full import DiskFull, disk_full


def _wrapped() -> Exception:
    """A worker's ENOSPC as it may reach the head: a RayTaskError carrying it, raised from another error."""
    cause = OSError(errno.ENOSPC, "No space left on device", "/runs/r/batches/b000002.parquet")
    task = ray.exceptions.RayTaskError("HashShuffleReduce", "traceback text", cause)
    try:
        try:
            raise task
        except ray.exceptions.RayTaskError as e:
            raise RuntimeError("Dataset execution aborted") from e
    except RuntimeError as outer:
        return outer


def test_a_full_disk_is_found_inside_what_wraps_it_and_names_the_file():
    full = disk_full(_wrapped(), "/runs/r")
    assert isinstance(full, DiskFull) and full.errno == errno.ENOSPC
    assert "out of disk space writing /runs/r/batches/b000002.parquet" in full.strerror and "rerun" in full.strerror
    assert disk_full(RuntimeError("no"), "/runs/r") is None
    assert disk_full(OSError(errno.EACCES, "Permission denied"), "/runs/r") is None
