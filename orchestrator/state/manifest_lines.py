"""Manifest lines held in a local temporary file instead of as records: what the head holds of the batches it no
longer needs as records, with the sums manifest_totals reads of them.

The head keeps its done batches so (RunState: a million done batches took 650 MB and seconds to build on every
resume): a done batch never changes again, so its line is written once and copied into every later manifest as
bytes, the running sha256 of those bytes is the start of every later manifest's digest, and what `status` and the
run summary read of the done batches is a few sums. The planner keeps the batches it packs so, window after window,
until it writes the first manifest. Either way what is held in memory does not grow with the batches held here.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from collections import Counter
from collections.abc import Iterator
from typing import BinaryIO


class ManifestLines:
    """Manifest lines (a temporary file, gone when closed or when the process dies) and their sums."""

    def __init__(self) -> None:
        self._file = tempfile.TemporaryFile(prefix="pagefleet-manifest-")  # unlinked at once: a crash leaves nothing
        self._sha256 = hashlib.sha256()
        self.counts: Counter[str] = Counter()
        """Lines per status."""
        self.prompts = self.prompts_done = self.samples_done = self.output_tokens = 0

    def add(self, line: bytes, status: str, num_prompts: int, num_samples: int, num_output_tokens: int) -> None:
        """A batch's manifest line (ending in a newline) and the figures of it that manifest_totals sums (a failed
        batch's are not: manifest_totals lists those, so they stay records)."""
        assert status != "failed", "a failed batch stays a record"
        self._file.write(line)
        self._sha256.update(line)
        self.counts[status] += 1
        self.prompts += num_prompts
        if status == "done":
            self.prompts_done += num_prompts
            self.samples_done += num_samples
            self.output_tokens += num_output_tokens

    def __len__(self) -> int:
        return sum(self.counts.values())

    def sha256(self) -> hashlib._Hash:
        """A sha256 that has read the lines so far (a copy: update it with what follows them)."""
        return self._sha256.copy()

    def copy_to(self, f: BinaryIO) -> None:
        """Write the lines to `f`."""
        self._file.flush()
        self._file.seek(0)
        shutil.copyfileobj(self._file, f, 1 << 20)
        self._file.seek(0, 2)  # appends go on at the end

    def data(self) -> bytes:
        """The lines (for a whole-object write to an object store)."""
        self._file.flush()
        self._file.seek(0)
        try:
            return self._file.read()
        finally:
            self._file.seek(0, 2)

    def batch_ids(self) -> Iterator[str]:
        """The batches' ids, read back from their lines (for the rare reader that needs them: a re-pack names its
        batches after every id the run has used)."""
        self._file.flush()
        self._file.seek(0)
        try:
            for line in self._file:
                yield json.loads(line)["batch_id"]
        finally:
            self._file.seek(0, 2)

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> ManifestLines:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
