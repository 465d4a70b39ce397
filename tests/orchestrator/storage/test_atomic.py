"""Local writes of whole files: a parquet file made in memory and written in one system call (batch files, outputs)."""

from __future__ import annotations

import os

import pyarrow as pa
import pyarrow.parquet as pq

from orchestrator.plan.tokenized import BATCH_SCHEMA, write_batch
from orchestrator.state.manifest import batch_id
from orchestrator.storage import atomic
from orchestrator.storage.atomic import atomic_write_parquet, write_whole


def _group(rows: int) -> pa.Table:
    return pa.table({"prompt_id": [f"p{i}" for i in range(rows)], "row": list(range(rows)),
                     "token_ids": [[i, i + 1, i + 2] for i in range(rows)], "passthrough": ['{"a": 1}'] * rows,
                     "sampling": [None] * rows, "continuations": [None] * rows}).cast(BATCH_SCHEMA)


def _count_writes(monkeypatch) -> list[int]:
    sizes: list[int] = []
    real = os.write

    def counted(fd, data):
        sizes.append(len(data))
        return real(fd, data)

    monkeypatch.setattr(os, "write", counted)
    return sizes


def test_a_batch_file_is_one_write_and_reads_back_with_the_umasks_mode(tmp_path, monkeypatch):
    # pyarrow's file writer made ~16 writes and seeks for a batch file (two a column chunk): ~0.3-0.5 ms a file on
    # ext4, the larger part of writing a plan's batch files.
    sizes = _count_writes(monkeypatch)
    group = _group(40)
    write_batch(group, 3, str(tmp_path), 100)
    path = tmp_path / f"{batch_id(3, 100)}.parquet"
    assert sizes == [path.stat().st_size]
    assert pq.read_table(path).equals(group)
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask
    atomic_write_parquet(tmp_path / "out.parquet", group)
    assert len(sizes) == 2 and pq.read_table(tmp_path / "out.parquet").equals(group)


def test_write_whole_writes_what_the_kernel_takes_in_pieces_and_truncates(tmp_path, monkeypatch):
    real = os.write
    monkeypatch.setattr(os, "write", lambda fd, data: real(fd, bytes(data[:7])))  # a short write each time
    path = tmp_path / "f"
    path.write_bytes(b"x" * 100)
    data = atomic.parquet_bytes(_group(5))
    write_whole(path, data)
    assert path.read_bytes() == data.to_pybytes()
