"""Page allocator invariants under any sequence of allocate / append / share / free / reset."""

from __future__ import annotations

import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.page_allocator import PageAllocationError, PageAllocator

NUM_PAGES = 12


class AllocatorMachine(RuleBasedStateMachine):
    """Sequences hold page lists; the model counts references independently of the allocator."""

    def __init__(self) -> None:
        super().__init__()
        self.alloc = PageAllocator(NUM_PAGES)
        self.seqs: list[list[int]] = []

    @rule(n=st.integers(0, 6))
    def allocate(self, n: int) -> None:
        free_before = self.alloc.num_free
        pages = self.alloc.allocate(n)
        if n > free_before:
            assert pages is None and self.alloc.num_free == free_before  # "not now", nothing taken
        else:
            assert pages is not None and len(set(pages)) == n
            assert all(self.alloc.refcount(p) == 1 for p in pages)
            self.seqs.append(pages)

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 100), n=st.integers(1, 3))
    def append(self, i: int, n: int) -> None:
        pages = self.alloc.allocate(n)
        if pages is not None:
            self.seqs[i % len(self.seqs)].extend(pages)

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 100), k=st.integers(0, 5))
    def share_prefix(self, i: int, k: int) -> None:
        """A new sequence shares the first k pages of another (n samples of one prompt)."""
        prefix = self.seqs[i % len(self.seqs)][:k]
        before = [self.alloc.refcount(p) for p in prefix]
        self.alloc.share(prefix)
        assert [self.alloc.refcount(p) for p in prefix] == [b + 1 for b in before]
        self.seqs.append(list(prefix))

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 100))
    def free(self, i: int) -> None:
        self.alloc.free(self.seqs.pop(i % len(self.seqs)))

    @rule()
    def reset(self) -> None:
        self.alloc.reset()
        self.seqs = []
        assert self.alloc.num_free == NUM_PAGES and self.alloc.max_refcount == 0

    @invariant()
    def invariants_hold(self) -> None:
        self.alloc.check(self.seqs)
        expected = {}
        for pages in self.seqs:
            for p in pages:
                expected[p] = expected.get(p, 0) + 1
        for p in range(NUM_PAGES):
            assert self.alloc.refcount(p) == expected.get(p, 0)
        assert self.alloc.num_free == NUM_PAGES - len(expected)


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_contract_violations_raise():
    alloc = PageAllocator(4)
    pages = alloc.allocate(2)
    alloc.free(pages)
    with pytest.raises(PageAllocationError, match="double free"):
        alloc.free(pages[:1])
    with pytest.raises(PageAllocationError, match="free"):
        alloc.share([3])
    assert alloc.allocate(5) is None and alloc.num_free == 4


def test_check_catches_a_free_page_still_mapped():
    alloc = PageAllocator(4)
    pages = alloc.allocate(1)
    alloc.free(pages)
    with pytest.raises(AssertionError, match="mapped by"):
        alloc.check([pages])
