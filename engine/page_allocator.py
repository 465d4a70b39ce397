"""Host-side page allocator: the only owner of which KV page belongs to which sequence. No JAX here.

Invariants (see `check`):
- a page is either free (reference count 0, on the free list exactly once) or in use (count >= 1);
- counts never go negative; freeing a free page is an error, not a silent no-op;
- after `reset` every page is free.
"""

from __future__ import annotations

from collections.abc import Iterable


class PageAllocationError(RuntimeError):
    """A caller broke the allocator's contract (double free, unknown page). Running out is not an error."""


class PageAllocator:
    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages must be at least 1, got {num_pages}")
        self.num_pages = num_pages
        self._refcount = [0] * num_pages
        # Pop from the end: page 0 is handed out first after a reset, which keeps runs reproducible.
        self._free = list(range(num_pages - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def refcount(self, page: int) -> int:
        return self._refcount[page]

    @property
    def max_refcount(self) -> int:
        return max(self._refcount)

    def allocate(self, num: int) -> list[int] | None:
        """`num` fresh pages with count 1, or None (nothing taken) when fewer than `num` are free."""
        if num < 0:
            raise ValueError(f"cannot allocate {num} pages")
        if num > len(self._free):
            return None
        pages = [self._free.pop() for _ in range(num)]
        for p in pages:
            self._refcount[p] = 1
        return pages

    def share(self, pages: Iterable[int]) -> None:
        """Add one reference to each page (another sequence maps it too)."""
        for p in pages:
            if self._refcount[p] < 1:
                raise PageAllocationError(f"cannot share page {p}: it is free")
            self._refcount[p] += 1

    def free(self, pages: Iterable[int]) -> None:
        """Drop one reference from each page; a page whose count reaches 0 returns to the free list."""
        for p in pages:
            if self._refcount[p] < 1:
                raise PageAllocationError(f"double free of page {p}")
            self._refcount[p] -= 1
            if self._refcount[p] == 0:
                self._free.append(p)

    def reset(self) -> None:
        """Forget every allocation (logical reset)."""
        self._refcount = [0] * self.num_pages
        self._free = list(range(self.num_pages - 1, -1, -1))

    def check(self, live_page_lists: Iterable[Iterable[int]] = ()) -> None:
        """Raise AssertionError if an invariant is broken; `live_page_lists` are the pages each live sequence maps."""
        counts = [0] * self.num_pages
        for pages in live_page_lists:
            for p in pages:
                counts[p] += 1
        free_set = set(self._free)
        assert len(free_set) == len(self._free), "a page is on the free list twice"
        for p, c in enumerate(self._refcount):
            assert c >= 0, f"page {p} has negative count {c}"
            assert (c == 0) == (p in free_set), f"page {p}: count {c} but free-list membership {p in free_set}"
            assert counts[p] <= c, f"page {p} is mapped by {counts[p]} live sequences but has count {c}"
            if c == 0:
                assert counts[p] == 0, f"free page {p} is mapped by a live sequence"
