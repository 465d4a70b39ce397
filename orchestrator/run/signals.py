"""How the head answers SIGINT and SIGTERM: a clean, resumable stop, never a kill mid-write."""

from __future__ import annotations

import signal
import threading


def on_signals(stop: threading.Event):
    """SIGINT/SIGTERM stop the run cleanly (resumable) instead of killing it mid-write."""
    if threading.current_thread() is not threading.main_thread():
        return None
    handler = lambda signum, frame: stop.set()  # noqa: E731
    return {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}


def interrupt_on_signals():
    """Before the slices start (planning, re-packing), SIGINT and SIGTERM raise KeyboardInterrupt: a clean stop
    (the command's one line and exit 130) rather than Ray's C-level stack dump for SIGTERM. Nothing is left
    half-done that a rerun does not redo: the plan is written last (batches.jsonl)."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    return {sig: signal.signal(sig, interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}


def restore_signals(previous) -> None:
    for sig, handler in (previous or {}).items():
        signal.signal(sig, handler)
