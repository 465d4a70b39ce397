"""A full disk is one line wherever it happens, also when a Ray worker's OSError arrives wrapped."""

from __future__ import annotations

import errno
import logging

import ray.exceptions

from orchestrator.observe.ray_noise import _DropReported
from orchestrator.state.disk_full import DiskFull, disk_full


def _wrapped() -> Exception:
    """A worker's ENOSPC as Ray Data raises it on the head: a RayTaskError carrying it, raised from another error."""
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


def test_ray_datas_console_drops_what_pagefleet_reports_and_keeps_other_errors():
    keep = _DropReported().filter

    def record(name: str, level: int, message: str, exc: BaseException | None = None) -> logging.LogRecord:
        return logging.LogRecord(name, level, __file__, 1, message, None,
                                 (type(exc), exc, None) if exc is not None else None)

    assert not keep(record("ray.data.exceptions", logging.ERROR, "Exception occurred in Ray Data or Ray Core"))
    assert not keep(record("ray.data._internal.x", logging.ERROR, "Reduce of partition 0 failed", _wrapped()))
    assert not keep(record("ray.data._internal.x", logging.ERROR, "OSError: [Errno 28] No space left on device"))
    assert keep(record("ray.data._internal.x", logging.ERROR, "Reduce of partition 0 failed", ValueError("bad")))
    assert keep(record("ray.data._internal.x", logging.WARNING, "resources are low"))
