"""What planning keeps from one window of rows to the next (planner.py packs the corpus a window at a time): the
accepted prompt ids of earlier windows, to reject a later row that reuses one, and the rejected rows' lines.

Both stay small beside the corpus: an id is kept as a 64-bit digest and its batch (12 bytes a prompt, 120 MB at 10M
prompts), and rejected lines go to a local file until the plan ends.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections import defaultdict
from pathlib import Path

import numpy as np

from orchestrator.state.batch_files import read_batch
from orchestrator.state.manifest import batch_id
from orchestrator.storage.atomic import atomic_write


def _digests(ids: list[str]) -> np.ndarray:
    # hash() is salted per process, which is all a plan needs: every digest is made and compared in this one.
    return np.fromiter((hash(i) for i in ids), dtype=np.int64, count=len(ids))


class SeenIds:
    """The accepted prompt ids of earlier windows: per window its ids' digests (sorted) and each one's batch. A digest
    that matches is checked against the id itself, read back from that batch's file, so a collision of two digests
    rejects nothing."""

    def __init__(self, batches_dir: str, id_bound: int) -> None:
        self.batches_dir, self.id_bound = batches_dir, id_bound
        self.windows: list[tuple[np.ndarray, np.ndarray]] = []

    def add(self, ids: list[str], batches: np.ndarray) -> None:
        """Remember a packed window's accepted `ids`, in the batches `batches` (one each)."""
        digests = _digests(ids)
        order = np.argsort(digests, kind="stable")
        self.windows.append((digests[order], np.asarray(batches, dtype=np.uint32)[order]))

    def earlier_rows(self, ids: list[str | None]) -> dict[int, int]:
        """{i: the row that already holds ids[i]} for each id an earlier window accepted (None ids are skipped)."""
        if not self.windows:
            return {}
        index = [i for i, pid in enumerate(ids) if pid is not None]
        digests = _digests([ids[i] for i in index])
        wanted: dict[int, set[str]] = defaultdict(set)  # batch -> ids to look for in its file
        for sorted_digests, batches in self.windows:
            at = np.searchsorted(sorted_digests, digests)
            for k in np.flatnonzero(sorted_digests[np.minimum(at, len(sorted_digests) - 1)] == digests):
                pos = at[k]
                while pos < len(sorted_digests) and sorted_digests[pos] == digests[k]:  # equal digests sit together
                    wanted[int(batches[pos])].add(ids[index[k]])
                    pos += 1
        found: dict[str, int] = {}
        for batch in sorted(wanted):
            table = read_batch(f"{self.batches_dir}/{batch_id(batch, self.id_bound)}.parquet", ["prompt_id", "row"])
            for pid, row in zip(table["prompt_id"].to_pylist(), table["row"].to_pylist()):
                if pid in wanted[batch]:
                    found[pid] = min(row, found.get(pid, row))
        return {i: found[pid] for i, pid in enumerate(ids) if pid is not None and pid in found}


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
