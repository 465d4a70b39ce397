"""Data crossing between the planning head and Ray workers in pieces small enough for Ray to pass inline.

Ray passes an object smaller than its `max_direct_call_object_size` (100 KiB by default) inside its task's messages
and keeps it in the receiving process's heap; a larger one goes to the node's shared-memory object store, and a
process that reads or writes it maps those pages. The head plans window after window and the store places each
window's summaries elsewhere, so the pages the head had mapped added up in its RSS, window after window, towards the
store's size (1.36 GiB at 10M short prompts against 0.91 GiB at 1M, for the same ~0.7 GiB of its own memory). Cut into
pieces of PIECE_BYTES, the window's summaries (to the head) and its rows' batches (from the head) stay in heap memory,
freed with the window.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np
import pyarrow as pa

PIECE_BYTES = 64 * 2**10
"""The size of a piece: under Ray's inline limit with room for its framing. A row larger than this (a summary of a
prompt of ~100k tokens) makes a larger piece, which Ray then passes through the object store: still correct."""


def table_pieces(table: pa.Table) -> Iterator[bytes]:
    """`table` as Arrow IPC streams of about PIECE_BYTES each, in row order (a slice's stream holds only its rows)."""
    rows = max(1, PIECE_BYTES * table.num_rows // max(1, table.nbytes))
    for start in range(0, table.num_rows, rows):
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table.slice(start, rows))
        yield sink.getvalue().to_pybytes()


def from_pieces(pieces: list[bytes], schema: pa.Schema) -> pa.Table:
    """The table of `table_pieces`' output, a chunk per piece (each over its piece's bytes: nothing is copied)."""
    if not pieces:
        return schema.empty_table()
    return pa.concat_tables([pa.ipc.open_stream(p).read_all() for p in pieces])


def array_pieces(values: np.ndarray) -> list[np.ndarray]:
    """A 1-D array as consecutive slices of about PIECE_BYTES each (np.concatenate gives it back; Ray sends a slice's
    own bytes, not its base's)."""
    step = max(1, PIECE_BYTES // max(1, values.itemsize))
    return [values[i:i + step] for i in range(0, len(values), step)] or [values[:0]]
