"""A slice's inbox: the batches the head sent (each with its file as read on arrival), in the head's order, and the
head's latest flow-control mark."""

from __future__ import annotations

import threading

from orchestrator.state.results import BatchWork


class Inbox:
    """Batches in the head's order (`BatchWork.seq`), whatever order the actor's threads deliver them in.

    `submit` calls run on a threaded actor, so two of them may run out of order; a multi-host slice must
    still feed every host the same batches in the same order.
    """

    def __init__(self) -> None:
        self._items: dict[int, tuple[BatchWork, object]] = {}  # seq -> (work, its prompts or the read error)
        self._next = 0
        self._changed = threading.Condition()
        self._last = -1
        self.wake_at: int | None = None
        """`BatchWork.wake_at` of the last batch the head sent (the highest seq received)."""

    def put(self, work: BatchWork, prompts: object) -> None:
        with self._changed:
            self._items[work.seq] = (work, prompts)
            if work.seq > self._last:
                self._last, self.wake_at = work.seq, work.wake_at
            self._changed.notify_all()

    def ready(self) -> bool:
        with self._changed:
            return self._next in self._items

    def get(self, timeout_s: float) -> tuple[BatchWork, object] | None:
        """The next (batch, prompts) in order, waiting up to `timeout_s`; None if it has not arrived."""
        with self._changed:
            if not self._changed.wait_for(lambda: self._next in self._items, timeout=timeout_s):
                return None
            self._next += 1
            return self._items.pop(self._next - 1)
