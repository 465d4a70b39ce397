"""Parquet reads from a local path or an object (the footer first, then the columns, by ranged reads)."""

from __future__ import annotations

import os
from pathlib import Path

from orchestrator.storage.location import Location
from orchestrator.storage.storage import is_url, open_file


def parquet_source(path: Path | Location):
    """What pyarrow.parquet reads: the local path itself, or a seekable file object over the object (the
    caller closes it) whose footer and column chunks are fetched with ranged reads."""
    return open_file(str(path), "rb") if isinstance(path, Location) else path


def read_parquet(path: str | os.PathLike, columns: list[str] | None = None):
    """pyarrow.parquet.read_table for a local path or an object (ranged reads of the footer and columns)."""
    import pyarrow.parquet as pq

    if not is_url(path):
        return pq.read_table(path, columns=columns)
    with open_file(str(path), "rb") as f:
        return pq.read_table(f, columns=columns)


def read_parquet_metadata(path: str | os.PathLike):
    import pyarrow.parquet as pq

    if not is_url(path):
        return pq.read_metadata(path)
    with open_file(str(path), "rb") as f:
        return pq.read_metadata(f)


def read_parquet_schema(path: str | os.PathLike):
    import pyarrow.parquet as pq

    if not is_url(path):
        return pq.read_schema(path)
    with open_file(str(path), "rb") as f:
        return pq.read_schema(f)
