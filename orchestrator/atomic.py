"""Durable writes: a temporary file in the same directory, fsync, then rename over the target."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path


def atomic_write(path: str | Path, write: Callable[[str], None], fsync: bool = True) -> None:
    """Call `write(tmp_path)`, fsync the result, and rename it to `path` (all or nothing).

    With `fsync=False` the rename is still atomic but not yet durable: the caller must `os.sync()`
    before anything that depends on the file (one barrier for many files instead of one each).
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        if fsync:
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    if not fsync:
        return
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    atomic_write(path, lambda tmp: Path(tmp).write_bytes(data))


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_parquet(path: str | Path, table, fsync: bool = True) -> None:
    import pyarrow.parquet as pq

    atomic_write(path, lambda tmp: pq.write_table(table, tmp), fsync=fsync)
