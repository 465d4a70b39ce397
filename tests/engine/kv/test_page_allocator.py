"""Page allocator invariants under any sequence of allocate / append / share / free / reset."""

from __future__ import annotations

import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.kv.page_allocator import PageAllocationError, PageAllocator

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


TOKENS = st.lists(st.integers(0, 1), min_size=1, max_size=3)  # few distinct pages: keys repeat often


class CachedAllocatorMachine(RuleBasedStateMachine):
    """The prefix cache's pages among sequences that map, cache, free and look up chains of pages.

    The model keeps what each page "holds" (the key it was computed for, set when it is cached and cleared
    when it is handed out again), so a lookup that returns a page whose content is not the key's, an eviction
    that takes a mapped page, or a page both free and mapped is caught."""

    def __init__(self) -> None:
        super().__init__()
        self.alloc = PageAllocator(NUM_PAGES)
        self.seqs: list[list[int]] = []
        self.content: dict[int, tuple] = {}  # page -> the key its KV was computed for (while cached)

    def _mapped(self) -> set[int]:
        return {p for pages in self.seqs for p in pages}

    @rule(tokens=TOKENS)
    def admit(self, tokens: list[int]) -> None:
        """A sequence whose prompt has len(tokens) full pages: map the cached leading ones, allocate and cache
        the rest (as the scheduler does when their chunk is scheduled)."""
        pages, parent = [], -1
        for t in tokens:
            key = (parent, (t,))
            page = self.alloc.lookup(key)
            if page is None:
                break
            assert self.content[page] == key, "a lookup returned a page computed for other tokens"
            self.alloc.share([page])
            pages.append(page)
            parent = page
        mapped_before = self._mapped()
        fresh = self.alloc.allocate(len(tokens) - len(pages))
        if fresh is None:
            self.alloc.free(pages)
            return
        assert not set(fresh) & mapped_before, "a page in use was handed out again"
        for p in fresh:
            self.content.pop(p, None)
        caching = True
        for t, p in zip(tokens[len(pages):], fresh):
            key = (parent, (t,))
            if caching and self.alloc.cache(p, key):
                self.content[p] = key
            else:
                caching = False  # later pages would chain from an uncached parent
            parent = p
        self.seqs.append(pages + fresh)

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 100))
    def free(self, i: int) -> None:
        self.alloc.free(self.seqs.pop(i % len(self.seqs)))

    @rule()
    def reset(self) -> None:
        self.alloc.free(p for pages in self.seqs for p in pages)
        self.seqs = []
        self.alloc.reset()
        assert self.alloc.num_cached == 0 and self.alloc.num_free == NUM_PAGES

    @invariant()
    def invariants_hold(self) -> None:
        self.alloc.check(self.seqs)
        mapped = self._mapped()
        assert self.alloc.num_free == NUM_PAGES - len(mapped)
        for p in range(NUM_PAGES):
            assert self.alloc.refcount(p) == sum(pages.count(p) for pages in self.seqs)


TestCachedAllocatorMachine = CachedAllocatorMachine.TestCase
TestCachedAllocatorMachine.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)


def test_reclaiming_a_cached_page_uncaches_its_descendants():
    alloc = PageAllocator(3)
    a, b = alloc.allocate(2)
    assert alloc.cache(a, (-1, (1,))) and alloc.cache(b, (a, (2,)))
    assert not alloc.cache(alloc.allocate(1)[0], (-1, (1,)))  # the key is held by page a
    alloc.free([a, b, 2])
    assert alloc.num_free == 3 and alloc.num_cached == 2
    assert alloc.allocate(1) == [2]  # a free page goes before any cached one
    assert alloc.allocate(1) == [b]  # then the least recently freed cached page: a prompt's last page first
    assert alloc.lookup((a, (2,))) is None and alloc.lookup((-1, (1,))) == a
    alloc.check([[2], [b]])
    alloc.free([b])
    assert alloc.allocate(2) == [b, a] and alloc.num_cached == 0  # reclaiming a uncaches it; b was free


def test_caching_a_page_under_an_uncached_parent_is_refused():
    alloc = PageAllocator(2)
    a, b = alloc.allocate(2)
    with pytest.raises(PageAllocationError, match="parent"):
        alloc.cache(b, (a, (1,)))
