"""One head per run directory: an exclusive `flock` on RUN_DIR/.lock, released by the OS on exit."""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path


class RunDirLocked(RuntimeError):
    """Another head holds the run directory."""


class RunLock:
    """Context manager holding RUN_DIR/.lock; the file names the holder (pid, host, since)."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / ".lock"
        self._fd: int | None = None
        self._made_dir = False  # this lock created the run directory (so a failed start may remove it)

    def __enter__(self) -> RunLock:
        self._made_dir = not self.path.parent.exists()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = holder_text(os.pread(fd, 4096, 0).decode(errors="replace"))
            os.close(fd)
            raise RunDirLocked(f"run directory {self.path.parent} is in use by {holder}; wait for that head to "
                               "finish or stop it (the lock is released when it exits)") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}).encode(), 0)
        self._fd = fd
        return self

    def check(self) -> None:
        """A `flock` is held until this process lets it go or exits: it cannot be lost (ObjectRunLock's can)."""

    def __exit__(self, exc_type, *exc) -> None:
        if self._fd is None:
            return
        # A start that failed before writing anything (a bad model path, say) leaves no directory holding
        # only `.lock` behind: it would read as a run. Removed while still locked, so no other head sees it.
        if exc_type is not None and self._made_dir and [p.name for p in self.path.parent.iterdir()] == [".lock"]:
            self.path.unlink()
            self.path.parent.rmdir()
        else:
            os.ftruncate(self._fd, 0)
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None


def holder_text(raw: str) -> str:
    """A lock's holder as a message names it: its JSON ({pid, host, since}) with `since` as a UTC time, not epoch
    seconds; anything else as it is."""
    raw = raw.strip()
    try:
        info = json.loads(raw)
    except ValueError:
        return raw or "an unknown process"
    if isinstance(info, dict) and isinstance(info.get("since"), (int, float)):
        info["since"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(info["since"]))
    return json.dumps(info)

