"""Checkpoint files on an object store (`gs://...`), read by byte ranges: no local copy, and each host reads only
the bytes its own devices hold.

A `RangedFile` stands in for the memory map of a local file: a buffer the size of the object (anonymous
memory, committed only where written) that holds only the byte ranges read so far. `engine.models.weights` takes
the same numpy views of it that it takes of a memory-mapped file (a tensor, transposed, reshaped, sliced to
one device's shard); `ensure(view)` first works out which bytes of the object that view covers and reads
those that are missing, several ranges at once, each with retries. A byte is read at most once per process,
however many of its devices need it.

Ranges closer together than `merge_gap` bytes are read as one request (a tensor split along its columns is a
run of short, evenly spaced ranges, one per row): a few extra bytes instead of thousands of requests. With
`merge_gap=0` exactly the bytes of the shards are read. Local paths go through the same helpers (`file_size`,
`read_range`, `read_text` of engine/files.py), so the header checks read either kind.
"""

from __future__ import annotations

import mmap
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from engine.files import file_size, read_range

MERGE_GAP = 1 << 20
"""Ranges of one file closer than this many bytes are read as one request."""
CHUNK = 32 << 20
"""Longer ranges are split into requests of at most this many bytes, read concurrently."""
WORKERS = 16
"""Requests in flight at once, per file."""


def byte_ranges(view: np.ndarray, base: np.ndarray) -> list[tuple[int, int]]:
    """The [start, end) byte ranges of `base` (a 1-D uint8 buffer) that `view`, a numpy view into it, covers;
    sorted, adjacent ones joined. Raises ValueError if `view` is not a view into `base` (a copy would read
    bytes that were never fetched)."""
    if view.size == 0:
        return []
    lo = base.__array_interface__["data"][0]
    low, high = np.lib.array_utils.byte_bounds(view)
    if not lo <= low <= high <= lo + base.size:
        raise ValueError("the part of a tensor to read must be a view of the checkpoint's buffer, not a copy")
    start = view.__array_interface__["data"][0] - lo
    dims = sorted((stride, n) for stride, n in zip(view.strides, view.shape) if n > 1)
    if any(stride <= 0 for stride, _ in dims):  # reversed or broadcast axes: read what the view spans
        return [(low - lo, high - lo)]
    run, i = view.itemsize, 0
    while i < len(dims) and dims[i][0] == run:  # the innermost axes that are contiguous make one run
        run *= dims[i][1]
        i += 1
    starts = np.array([start], dtype=np.int64)
    for stride, n in dims[i:]:
        starts = (starts[:, None] + stride * np.arange(n, dtype=np.int64)[None, :]).ravel()
    return _merge([(int(s), int(s) + run) for s in np.sort(starts)], 0)


def _merge(ranges: list[tuple[int, int]], gap: int) -> list[tuple[int, int]]:
    """Sorted ranges with those at most `gap` bytes apart joined."""
    out: list[list[int]] = []
    for s, e in sorted(ranges):
        if out and s - out[-1][1] <= gap:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def _missing(ranges: list[tuple[int, int]], have: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of `ranges` that no range of `have` (sorted, disjoint) covers."""
    out = []
    for s, e in ranges:
        for hs, he in have:
            if he <= s or hs >= e:
                continue
            if hs > s:
                out.append((s, hs))
            s = max(s, he)
            if s >= e:
                break
        if s < e:
            out.append((s, e))
    return out


class RangedFile:
    """An object's bytes as a buffer that `ensure` fills in by ranged reads (see the module docstring)."""

    def __init__(self, url: str, merge_gap: int = MERGE_GAP) -> None:
        self.url, self.merge_gap = url, merge_gap
        self.size = file_size(url)
        self._map = mmap.mmap(-1, max(self.size, 1))  # anonymous: pages are committed only once written
        self.buffer = np.frombuffer(self._map, dtype=np.uint8)[:self.size]
        self._have: list[tuple[int, int]] = []
        self._lock = threading.Lock()
        self.bytes_read = 0
        self.requests = 0

    def ensure(self, view: np.ndarray) -> None:
        """Read whatever bytes of `view` (a view into `self.buffer`) have not been read yet."""
        with self._lock:
            todo = _merge(_missing(byte_ranges(view, self.buffer), self._have), self.merge_gap)
            if not todo:
                return
            pieces = [(s, min(s + CHUNK, e)) for s, e in todo for s in range(s, e, CHUNK)]
            with ThreadPoolExecutor(min(WORKERS, len(pieces))) as pool:
                for (s, e), data in zip(pieces, pool.map(lambda r: read_range(self.url, *r), pieces)):
                    if len(data) != e - s:
                        raise OSError(f"{self.url}: asked for bytes {s:,} to {e:,}, got {len(data):,}; the object "
                                      "changed or is truncated")
                    self.buffer[s:e] = np.frombuffer(data, dtype=np.uint8)
            self._have = _merge(self._have + todo, 0)
            self.bytes_read += sum(e - s for s, e in todo)
            self.requests += len(pieces)
