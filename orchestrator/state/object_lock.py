"""One head per run directory on an object store: RUN_DIR/.lock as an object, with no `flock` to lean on.

- Taking the lock creates the object only if none is there (`ifGenerationMatch=0`): of two heads that
  try at once, exactly one succeeds, whichever machines they run on.
- The holder refreshes it every `refresh_s` by replacing it under a precondition on the generation it
  last wrote, so the object's update time (the store's clock) says the holder is alive.
- A lock not refreshed for `stale_after_s` belongs to a head that is gone (killed, its machine lost):
  a new head takes it over by replacing it under a precondition on the generation it read, so of two
  heads taking over at once only one wins; the message names the holder it replaced.
- A holder whose refresh finds another generation, or no object, has lost the lock (it stalled past
  `stale_after_s` and was taken over, or another process replaced or removed the object); so has one
  whose refreshes have failed for nearly `stale_after_s` (another head may take over any moment).
  `check` then raises RunDirLocked, which the head calls every turn of its loop (driver.py), and its
  next manifest write fails on its own precondition too.

Staleness compares the store's update time with this machine's clock: hosts' clocks must agree to well
within `stale_after_s` (NTP keeps them within milliseconds).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time

from orchestrator.state.lock import RunDirLocked, holder_text
from orchestrator.storage import generations, storage

STALE_AFTER_S = 60.0
"""A lock not refreshed for this long belongs to a head that is gone."""
REFRESH_S = 10.0
"""How often the holder refreshes its lock (several times within STALE_AFTER_S, so a slow request is no loss)."""


class ObjectRunLock:
    """Context manager holding RUN_DIR/.lock on an object store; the object names the holder (pid, host, since)."""

    def __init__(self, run_dir: str, stale_after_s: float = STALE_AFTER_S, refresh_s: float = REFRESH_S) -> None:
        if refresh_s >= stale_after_s:
            raise ValueError(f"refresh_s ({refresh_s}) must be well under stale_after_s ({stale_after_s})")
        self.root = str(run_dir).rstrip("/")
        self.url = storage.join(self.root, ".lock")
        self.stale_after_s, self.refresh_s = stale_after_s, refresh_s
        self.generation: int | None = None
        self.took_over_from: str | None = None
        """The stale holder this lock replaced, as its lock object named it (None: the lock was free)."""
        self.lost: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._holder = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}

    def _body(self) -> bytes:
        return json.dumps(self._holder).encode()

    def __enter__(self) -> ObjectRunLock:
        try:
            self.generation = generations.create_if_absent(self.url, self._body())
        except generations.PreconditionFailed:
            self._take_over()
        self._thread = threading.Thread(target=self._refresh, name="run-lock-refresh", daemon=True)
        self._thread.start()
        return self

    def _take_over(self) -> None:
        current = generations.read_with_generation(self.url)
        if current is None:  # released between our two requests: try again from the start
            self.generation = generations.create_if_absent(self.url, self._body())
            return
        data, generation = current
        holder = holder_text(data.decode(errors="replace"))
        info = generations.object_info(self.url)
        age_s = time.time() - info["updated"] if info and info["generation"] == generation else 0.0
        if age_s < self.stale_after_s:
            raise RunDirLocked(
                f"run directory {self.root} is in use by {holder} (its lock was refreshed {age_s:.0f} s ago); wait "
                f"for that head to finish or stop it; if it is gone, its lock is taken over once it is "
                f"{self.stale_after_s:.0f} s old")
        try:
            self.generation = generations.replace_if_generation(self.url, self._body(), generation)
        except generations.PreconditionFailed:
            raise RunDirLocked(f"run directory {self.root}: another head took over the stale lock of {holder} "
                               "first") from None
        self.took_over_from = holder

    def _refresh(self) -> None:
        last_ok = time.monotonic()  # when a refresh last landed: the store's copy is at most this old
        while not self._stop.wait(self.refresh_s):
            try:
                try:
                    self.generation = generations.replace_if_generation(self.url, self._body(), self.generation)
                except generations.PreconditionFailed:
                    current = generations.read_with_generation(self.url)
                    if current is None or current[0] != self._body():
                        self._lose(current)
                        return
                    self.generation = current[1]  # our last refresh landed, its reply did not
                last_ok = time.monotonic()
            except Exception:  # noqa: BLE001 - a failed request: the next refresh tries again, well before stale
                if time.monotonic() - last_ok >= self.stale_after_s - self.refresh_s:
                    self.lost = (f"lost the lock on run directory {self.root}: it could not be refreshed for "
                                 f"{time.monotonic() - last_ok:.0f} s (the bucket did not answer), so another head "
                                 f"may take it over at {self.stale_after_s:.0f} s; this head stopped. Check this "
                                 "machine's access to the bucket, then rerun to resume")
                    return

    def _lose(self, current: tuple[bytes, int] | None) -> None:
        """Record that RUN_DIR/.lock is no longer this head's (`current`: what is there now, if anything)."""
        if current is None:
            how = "its lock object was removed by another process"
        else:
            who = current[0].decode(errors="replace").strip() or "an unknown process"
            how = f"another head took it over ({who}), or another process replaced the lock object"
        self.lost = (f"lost the lock on run directory {self.root}: {how}; this head stopped and writes nothing more "
                     "there. The other head owns the run now; if this head was only slow (no refresh for "
                     f"lock_stale_s={self.stale_after_s:g} s), raise lock_stale_s")

    def check(self) -> None:
        """Raise RunDirLocked if another head has taken this lock over."""
        if self.lost is not None:
            raise RunDirLocked(self.lost)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.lost is None and self.generation is not None:
            try:
                generations.delete_if_generation(self.url, self.generation)
            except generations.PreconditionFailed:
                pass  # taken over meanwhile: it is the new holder's now
        self.generation = None


def holder(run_dir: str, stale_after_s: float = STALE_AFTER_S) -> dict | None:
    """The head holding `run_dir`'s lock ({pid, host, since}), or None when there is none or it is stale."""
    url = storage.join(run_dir, ".lock")
    current = generations.read_with_generation(url)
    info = generations.object_info(url)
    if current is None or info is None or time.time() - info["updated"] >= stale_after_s:
        return None
    try:
        return json.loads(current[0])
    except ValueError:
        return {"pid": None, "host": None, "since": None}
