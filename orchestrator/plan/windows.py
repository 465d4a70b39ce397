"""What planning keeps from one window of rows to the next (planner.py packs the corpus a window at a time): the
accepted prompt ids of earlier windows, to reject a later row that reuses one, and the rejected rows' lines.

Neither is held in memory: an id is kept as a 64-bit digest and its batch (12 bytes a prompt, computed from the Arrow
buffers without a Python string a row) in a local temporary file per window, and rejected lines go to a local file
until the plan ends.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections import defaultdict
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from orchestrator.state.batch_files import read_batch
from orchestrator.state.manifest import batch_id
from orchestrator.storage.atomic import atomic_write


_PRIME = np.uint64(0x100000001B3)  # FNV's 64-bit prime: odd, so every byte's weight is a unit mod 2**64
_CHUNK = 16_384


def _digests(ids: pa.Array) -> np.ndarray:
    """A 64-bit digest of each string (a polynomial in its UTF-8 bytes, mod 2**64; null as empty), from the Arrow
    buffers at once: no Python string is made, so a window's million ids leave no garbage behind in the head. Equal
    strings get equal digests; unequal ones rarely do, and SeenIds checks every match against the id itself."""
    if isinstance(ids, pa.ChunkedArray):
        ids = ids.combine_chunks()
    if len(ids) > _CHUNK:  # the arrays below take ~30 bytes per byte of ids: a chunk at a time keeps them small
        return np.concatenate([_digests(ids.slice(i, _CHUNK)) for i in range(0, len(ids), _CHUNK)])
    ids = pc.fill_null(ids.cast(pa.large_string()), "")
    if len(ids) == 0:
        return np.zeros(0, np.uint64)
    offsets = np.frombuffer(ids.buffers()[1], dtype=np.int64)[ids.offset:ids.offset + len(ids) + 1]
    data = np.frombuffer(ids.buffers()[2] or b"", dtype=np.uint8)[offsets[0]:offsets[-1]]
    starts, ends = offsets[:-1] - offsets[0], offsets[1:] - offsets[0]
    lengths = ends - starts
    with np.errstate(over="ignore"):  # arithmetic mod 2**64 is the point
        powers = np.ones(int(lengths.max()) + 1, np.uint64)
        powers[1:] = np.cumprod(np.full(len(powers) - 1, _PRIME, dtype=np.uint64))
        from_end = np.repeat(ends - 1, lengths) - np.arange(len(data))  # each byte's place, counted from its id's end
        terms = (data.astype(np.uint64) + np.uint64(1)) * powers[from_end]
        running = np.concatenate([np.zeros(1, np.uint64), np.cumsum(terms, dtype=np.uint64)])
        return (running[ends] - running[starts]) * _PRIME + lengths.astype(np.uint64)


class SeenIds:
    """The accepted prompt ids of earlier windows: per window its ids' digests (sorted) and each one's batch, in a local
    temporary directory (12 bytes a prompt: 1.2 GB at 100M prompts is not for the head's memory), read back a chunk at
    a time to check a new window's ids. A digest that matches is checked against the id itself, read back from that
    batch's file, so a collision of two digests rejects nothing."""

    def __init__(self, batches_dir: str, id_bound: int) -> None:
        self.batches_dir, self.id_bound = batches_dir, id_bound
        self._dir = tempfile.TemporaryDirectory(prefix="pagefleet-seen-ids-")
        self.windows: list[tuple[str, int]] = []
        """(the files' path without suffix, how many ids) per window added."""

    def add(self, ids: pa.Array, batches: np.ndarray) -> None:
        """Remember a packed window's accepted `ids` (strings), in the batches `batches` (one each)."""
        digests = _digests(ids)
        order = np.argsort(digests, kind="stable")
        path = f"{self._dir.name}/{len(self.windows)}"
        digests[order].tofile(f"{path}.digests")
        np.asarray(batches, dtype=np.uint32)[order].tofile(f"{path}.batches")
        self.windows.append((path, len(order)))

    def earlier_rows(self, ids: pa.Array) -> dict[int, int]:
        """{i: the row that already holds ids[i]} for each id (strings, no nulls) an earlier window accepted."""
        if not self.windows or len(ids) == 0:
            return {}
        digests = _digests(ids)
        by_digest = np.argsort(digests, kind="stable")
        queries = digests[by_digest]  # sorted: equal digests sit together
        wanted: dict[int, set[str]] = defaultdict(set)  # batch -> ids to look for in its file
        candidates: dict[int, str] = {}
        for path, count in self.windows:
            for start in range(0, count, _READ):
                seen = np.fromfile(f"{path}.digests", dtype=np.uint64, count=min(_READ, count - start),
                                   offset=8 * start)
                first = np.searchsorted(queries, seen, side="left")
                last = np.searchsorted(queries, seen, side="right")
                hits = np.flatnonzero(last > first)
                if not len(hits):
                    continue
                batches = np.fromfile(f"{path}.batches", dtype=np.uint32, count=len(seen), offset=4 * start)[hits]
                for hit, batch in zip(hits.tolist(), batches.tolist()):
                    for k in by_digest[first[hit]:last[hit]].tolist():
                        candidates[k] = pid = ids[k].as_py()
                        wanted[batch].add(pid)
        found: dict[str, int] = {}
        for batch in sorted(wanted):
            table = read_batch(f"{self.batches_dir}/{batch_id(batch, self.id_bound)}.parquet", ["prompt_id", "row"])
            for pid, row in zip(table["prompt_id"].to_pylist(), table["row"].to_pylist()):
                if pid in wanted[batch]:
                    found[pid] = min(row, found.get(pid, row))
        return {k: found[pid] for k, pid in candidates.items() if pid in found}

    def close(self) -> None:
        self._dir.cleanup()

    def __enter__(self) -> SeenIds:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_READ = 1 << 20  # ids of an earlier window read back at a time (8 MiB of digests)


class LineSpool:
    """Lines appended window by window to a local temporary file, then put in place as one file, atomically (a local
    path or an object store URL)."""

    def __init__(self) -> None:
        fd, self.path = tempfile.mkstemp(prefix=".pagefleet-spool-", suffix=".jsonl")
        self.file = os.fdopen(fd, "w", encoding="utf-8")

    def write(self, lines: list[str]) -> None:
        self.file.writelines(line + "\n" for line in lines)

    def commit(self, target: str | Path) -> None:
        self.file.close()
        atomic_write(target, lambda tmp: shutil.copyfile(self.path, tmp))

    def close(self) -> None:
        if not self.file.closed:
            self.file.close()
        if os.path.exists(self.path):
            os.unlink(self.path)

    def __enter__(self) -> LineSpool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
