"""Appending lines to a file that may live on an object store, which has no append."""

from __future__ import annotations

import os

from orchestrator.storage.storage import exists, is_object_store, read_text, write_atomic


class _ObjectAppender:
    """A text file opened for appending on an object store, which has no append: the whole object is
    rewritten (one atomic write) with everything so far, at most every `interval_s` on `flush` and always
    on `close`. A crash loses at most the last `interval_s` of lines (events.log, timeline.jsonl: for
    people and plots, never the resume point)."""

    def __init__(self, url: str, interval_s: float = 5.0) -> None:
        import time

        self.url, self.interval_s, self._time = url, interval_s, time.monotonic
        self._parts = [read_text(url)] if exists(url) else []
        self._dirty, self._last = False, 0.0

    def write(self, text: str) -> int:
        self._parts.append(text)
        self._dirty = True
        return len(text)

    def flush(self, force: bool = False) -> None:
        if self._dirty and (force or self._time() - self._last >= self.interval_s):
            write_atomic(self.url, "".join(self._parts).encode("utf-8"))
            self._dirty, self._last = False, self._time()

    def close(self) -> None:
        self.flush(force=True)

    def __enter__(self) -> _ObjectAppender:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_append(path: str | os.PathLike):
    """A text file to append lines to: the file itself locally, an `_ObjectAppender` on an object store."""
    if is_object_store(path):
        return _ObjectAppender(str(path))
    return open(path, "a", encoding="utf-8")
