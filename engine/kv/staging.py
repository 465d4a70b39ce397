"""Page-ins a step ahead: the waiting sequences staged, and whether one more may be. Part of the KV cache manager.
No JAX.

A sequence that needs pages paged in (swapped out, or a prefix continuing in the host tier), reached by
admission while other sequences run the step, is staged (engine/kv/swap.py): pages mapped, page-ins issued with
this step, admitted in a later one. A staged sequence keeps its place and its slot in the queue, and its pages:
it is staged only when the free pages cover its pages now and what every staged sequence needs to grow into
its next chunk (`has_room`), so when nothing else runs the first staged sequence can always be admitted;
otherwise it is admitted as before, its page-ins issued with the step that reads them. The staged sequences
are a prefix of the queue: a preempted sequence goes back after them (Scheduler._preempt).
"""

from __future__ import annotations

from collections.abc import Iterable

from engine.kv.page_allocator import PageAllocator
from engine.scheduling.sequence import Sequence


class Staging:
    def __init__(self, page_size: int, allocator: PageAllocator, num_groups: int = 1) -> None:
        self.page_size = page_size
        self.allocator = allocator
        self.num_groups = num_groups  # a page of a sequence is a unit in each layer group (engine/kv/kv_groups.py)
        self.seqs: list[Sequence] = []  # waiting sequences staged (their page-ins issued), oldest first

    def has_room(self, seq: Sequence, num_pages: int) -> bool:
        """Whether staging `seq`, which maps `num_pages` more pages (of each group) now, leaves free pages for every staged
        sequence (it too) to grow into all its pending tokens at its admission. A staged sequence never gives its
        pages back (its page-ins would be paid twice), so this keeps the first one admissible whatever runs."""
        ps = self.page_size
        later = (sum(q.pages_short(q.num_pending, ps) for q in self.seqs)
                 + max(0, seq.pages_short(seq.num_pending, ps) - num_pages))
        return (num_pages + later) * self.num_groups <= self.allocator.num_free

    def add(self, seq: Sequence) -> None:
        self.seqs.append(seq)

    def remove(self, seq: Sequence) -> None:
        """A staged sequence is admitted: its page-ins have landed."""
        self.seqs.remove(seq)

    def reset(self) -> None:
        self.seqs = []

    def check(self, waiting: Iterable[Sequence]) -> None:
        assert all(s.staged for s in self.seqs) and sum(s.staged for s in waiting) == len(self.seqs)
