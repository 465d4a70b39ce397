"""The done batches of a run as the head holds them: not as records (a million of them took 650 MB and seconds to
build on every resume) but as their manifest lines, appended to a local temporary file, with their count and sums.

A done batch never changes again (a resume that finds its output missing or damaged puts it back to pending before
the head spools it), so its line is written once and copied into every later manifest as bytes, the running sha256
of those bytes is the start of every later manifest's digest, and what `status` and the run summary read of the done
batches (manifest_totals) is four sums. What the head holds then grows with the batches still to do, not with the
finished ones.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from collections.abc import Iterator
from typing import BinaryIO


class DoneBatches:
    """Done batches' manifest lines (a temporary file, gone when closed or when the process dies) and their sums."""

    def __init__(self) -> None:
        self._file = tempfile.TemporaryFile(prefix="pagefleet-done-")  # unlinked at once: a crash leaves nothing
        self._sha256 = hashlib.sha256()
        self.count = self.prompts = self.samples = self.output_tokens = 0

    def add(self, line: bytes, num_prompts: int, num_samples: int, num_output_tokens: int) -> None:
        """A done batch: its manifest line (ending in a newline) and the figures manifest_totals sums."""
        self._file.write(line)
        self._sha256.update(line)
        self.count += 1
        self.prompts += num_prompts
        self.samples += num_samples
        self.output_tokens += num_output_tokens

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
        """The done batches' ids, read back from their lines (for the rare reader that needs them: a re-pack names
        its batches after every id the run has used)."""
        self._file.flush()
        self._file.seek(0)
        try:
            for line in self._file:
                yield json.loads(line)["batch_id"]
        finally:
            self._file.seek(0, 2)

    def close(self) -> None:
        self._file.close()
