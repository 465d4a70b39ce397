"""Host-side page allocators: the only owner of which KV page belongs to which sequence, of the prefix cache's
pages (PageAllocator) and of which host pool page holds a swapped-out page (HostPageAllocator). No JAX here.

A page is in exactly one of three states:
- in use: reference count >= 1 (mapped by that many sequences);
- cached and evictable: count 0, its KV still valid and findable by its key, in an LRU order;
- free: count 0, not cached, on the free list exactly once.

The prefix cache identifies a full, computed prompt page by its key `(parent, tokens)`: the page holding the
previous page's tokens of the same prompt (-1 for the first page) and the page's own token ids. The parent
stands for the whole chain before it, so the key names every token the page's KV depends on; the lookup is a
dict lookup, which confirms the key by equality (a hash collision can never map the wrong KV). A cached page
stays cached while its count is 0 and is only reclaimed (least recently freed first) when `allocate` runs
out of free pages; reclaiming a page uncaches its descendants too (their keys name it). They are not in use
then, since a sequence maps a prompt's pages from the first one on, except in a sliding-window layer group
(engine/kv/kv_groups.py), whose sequence gives back the pages before its window: a descendant it still holds stays
in use, uncached, and the sequence caches no page after it.

Each cached page also carries a uid, its identity across tiers: the host tier (engine/kv/host_cache.py) keys a
spilled page by its parent's uid, since a device page number is reused once the page is reclaimed. When
`allocate` reclaims cached pages it hands them to `on_evict` (parent first), which may copy them to the host
tier before they are reused; a page paged back in is cached again under its old uid.

Invariants (see `check`): counts never go negative; freeing a page whose count is 0 is an error, not a
silent no-op; a cached page's parent is cached; after `reset` every page is free and nothing is cached.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable

PageKey = tuple[int, tuple[int, ...]]
"""A cached page's identity: (parent page, or -1 - its layer group for a prompt's first page, the page's token ids)."""


def page_key(pages: list[int], token_ids: list[int], i: int, page_size: int, group: int = 0) -> PageKey | None:
    """The key of page i of a sequence's page list in one layer group (engine/kv/kv_groups.py): the page before it
    (-1 - group for the first: each group's chain has its own root) and the page's token ids; None when the page
    before it was given back (kv_groups.NONE, a window shorter than a page): the chain cannot go on."""
    parent = pages[i - 1] if i else -1 - group
    if i and parent < 0:
        return None
    return parent, tuple(token_ids[i * page_size:(i + 1) * page_size])


class PageAllocationError(RuntimeError):
    """A caller broke the allocator's contract (double free, unknown page). Running out is not an error."""


EvictedPage = tuple[int, int, tuple[int, ...], int]
"""A reclaimed cached page as `on_evict` gets it: (device page, parent's uid or -1, token ids, uid)."""


class PageAllocator:
    def __init__(self, num_pages: int, on_evict: Callable[[list[EvictedPage]], None] | None = None) -> None:
        """`on_evict`: called with the cached pages `allocate` reclaims (parents before children), before any
        of them is handed out."""
        if num_pages < 1:
            raise ValueError(f"num_pages must be at least 1, got {num_pages}")
        self.num_pages = num_pages
        self.on_evict = on_evict
        self._next_uid = 0
        self.reset()

    @property
    def num_free(self) -> int:
        """Pages `allocate` can hand out: free ones and cached ones no sequence maps."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_pages - self.num_free

    @property
    def num_cached(self) -> int:
        """Pages the prefix cache can serve (in use or evictable)."""
        return len(self._page_of)

    def is_cached(self, page: int) -> bool:
        return self._key[page] is not None

    def uid(self, page: int) -> int:
        """A cached page's uid (its identity in every tier), -1 for an uncached one."""
        return self._uid[page]

    def refcount(self, page: int) -> int:
        return self._refcount[page]

    @property
    def max_refcount(self) -> int:
        return max(self._refcount)

    def allocate(self, num: int) -> list[int] | None:
        """`num` pages with count 1, uncached, or None (nothing taken) when fewer than `num` can be had. Free
        pages go first; then the least recently freed cached pages are reclaimed."""
        if num < 0:
            raise ValueError(f"cannot allocate {num} pages")
        if num > self.num_free:
            return None
        pages = []
        for _ in range(num):
            if not self._free:
                self._uncache(next(iter(self._evictable)))  # puts it (and its descendants) on the free list
            pages.append(self._free.pop())
        for p in pages:
            self._refcount[p] = 1
        return pages

    def share(self, pages: Iterable[int]) -> None:
        """Add one reference to each page (another sequence maps it too); a cached page nobody mapped leaves
        the evictable set."""
        for p in pages:
            if self._refcount[p] == 0:
                if p not in self._evictable:
                    raise PageAllocationError(f"cannot share page {p}: it is free")
                del self._evictable[p]
            self._refcount[p] += 1

    def free(self, pages: Iterable[int]) -> None:
        """Drop one reference from each page. A page whose count reaches 0 returns to the free list, or, when
        cached, to the evictable set, last page first: a prompt's later pages are reclaimed before the earlier
        ones that other prompts share."""
        evictable = []
        for p in pages:
            if self._refcount[p] < 1:
                raise PageAllocationError(f"double free of page {p}")
            self._refcount[p] -= 1
            if self._refcount[p] == 0:
                if self._key[p] is None:
                    self._free.append(p)
                else:
                    evictable.append(p)
        for p in reversed(evictable):
            self._evictable[p] = None

    # -- the prefix cache --------------------------------------------------------------------------

    def lookup(self, key: PageKey) -> int | None:
        """The cached page under `key`, or None."""
        return self._page_of.get(key)

    def lookup_chain(self, token_ids: list[int], end: int, page_size: int, num_groups: int) -> list[list[int]]:
        """The cached pages holding the leading full pages of `token_ids` (at most `end`) in each of `num_groups`
        layer groups, as many in every group, shared (mapped once more): one page list per group, or [] for none."""
        found: list[list[int]] = [[] for _ in range(num_groups)]
        for i in range(end):
            pages = [self.lookup(page_key(found[g], token_ids, i, page_size, g)) for g in range(num_groups)]
            if None in pages:
                break
            for g, page in enumerate(pages):
                found[g].append(page)
        if not found[0]:
            return []
        for pages in found:
            self.share(pages)
        return found

    def cache(self, page: int, key: PageKey, uid: int | None = None) -> bool:
        """Make an in-use page findable under `key` (its KV is, or is being, computed for those tokens); False
        when another page already holds the key (the page stays uncached). `uid`: the identity the page had
        before (paged back in from the host tier); a new one otherwise."""
        if self._refcount[page] < 1 or self._key[page] is not None:
            raise PageAllocationError(f"cannot cache page {page}: it is free or cached already")
        parent = key[0]
        if parent >= 0 and self._key[parent] is None:
            raise PageAllocationError(f"cannot cache page {page}: its parent page {parent} is not cached")
        if key in self._page_of:
            return False
        self._page_of[key] = page
        self._key[page] = key
        if uid is None:
            uid, self._next_uid = self._next_uid, self._next_uid + 1
        self._uid[page] = uid
        if parent >= 0:
            self._children.setdefault(parent, []).append(page)
        return True

    def _uncache(self, page: int) -> None:
        """Forget `page` and every page whose key descends from it (they are never in use: see the module
        docstring); they become free, and `on_evict` gets them, parents first."""
        stack = [page]
        parent = self._key[page][0]
        if parent >= 0:
            self._children[parent].remove(page)
        evicted: list[EvictedPage] = []
        while stack:
            p = stack.pop()
            parent, tokens = self._key[p]
            evicted.append((p, self._uid[parent] if parent >= 0 else -1, tokens, self._uid[p]))
            del self._page_of[self._key[p]]
            stack.extend(self._children.pop(p, ()))
            if p in self._evictable:
                del self._evictable[p]
                self._free.append(p)
        for p, *_ in evicted:  # after the walk: a child reads its parent's uid
            self._key[p] = None
            self._uid[p] = -1
        if self.on_evict is not None:
            self.on_evict(evicted)

    def reset(self) -> None:
        """Forget every allocation and the cache (logical reset)."""
        self._refcount = [0] * self.num_pages
        # Pop from the end: page 0 is handed out first after a reset, which keeps runs reproducible.
        self._free = list(range(self.num_pages - 1, -1, -1))
        self._key: list[PageKey | None] = [None] * self.num_pages
        self._uid = [-1] * self.num_pages  # a cached page's uid; the counter survives resets: never reused
        self._page_of: dict[PageKey, int] = {}
        self._children: dict[int, list[int]] = {}  # cached page -> cached pages whose key names it as parent
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, count 0; least recently freed first

    def check(self, live_page_lists: Iterable[Iterable[int]] = ()) -> None:
        """Raise AssertionError if an invariant is broken; `live_page_lists` are the pages each live sequence maps."""
        counts = [0] * self.num_pages
        for pages in live_page_lists:
            for p in pages:
                counts[p] += 1
        free_set = set(self._free)
        assert len(free_set) == len(self._free), "a page is on the free list twice"
        assert not free_set & set(self._evictable), "a page is both free and evictable"
        for p, c in enumerate(self._refcount):
            assert c >= 0, f"page {p} has negative count {c}"
            cached = self._key[p] is not None
            assert (c == 0 and not cached) == (p in free_set), f"page {p}: count {c}, cached {cached}, free {p in free_set}"
            assert (c == 0 and cached) == (p in self._evictable), f"page {p}: count {c}, cached {cached}, evictable"
            assert cached == (self._uid[p] >= 0), f"page {p}: cached {cached} but uid {self._uid[p]}"
            assert counts[p] <= c, f"page {p} is mapped by {counts[p]} live sequences but has count {c}"
            if cached:
                assert self._page_of[self._key[p]] == p, f"page {p}'s key maps to another page"
                parent = self._key[p][0]
                assert parent < 0 or self._key[parent] is not None, f"cached page {p}'s parent {parent} is not cached"
                assert parent < 0 or p in self._children[parent], f"cached page {p} is not among its parent's children"
        assert len(self._page_of) == sum(k is not None for k in self._key), "a key maps to an uncached page"


class HostPageAllocator:
    """The host KV pool's bookkeeping (`engine.host_kv_pages`): which host pages are taken. Each host page is
    free or held by exactly one owner: a swapped-out sequence, an entry of the prefix cache's host tier, or a
    page-in of the step being decided (freed when it is handed over); the data sits in the runner's KVCache.
    Bounded: `allocate` answers None (nothing taken) past `num_pages`, and the scheduler then recomputes."""

    def __init__(self, num_pages: int) -> None:
        if num_pages < 0:
            raise ValueError(f"host num_pages must be at least 0, got {num_pages}")
        self.num_pages = num_pages
        self.reset()

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def is_used(self, page: int) -> bool:
        return self._used[page]

    def allocate(self, num: int) -> list[int] | None:
        if num < 0:
            raise ValueError(f"cannot allocate {num} host pages")
        if num > len(self._free):
            return None
        pages = [self._free.pop() for _ in range(num)]
        for p in pages:
            self._used[p] = True
        self.peak_used = max(self.peak_used, self.num_used)
        return pages

    def free(self, pages: Iterable[int]) -> None:
        for p in pages:
            if not self._used[p]:
                raise PageAllocationError(f"double free of host page {p}")
            self._used[p] = False
            self._free.append(p)

    def reset(self) -> None:
        self._free = list(range(self.num_pages - 1, -1, -1))  # host page 0 first, as on the device
        self._used = [False] * self.num_pages
        self.peak_used = 0

    def check(self, held: Iterable[Iterable[int]] = ()) -> None:
        """Raise AssertionError unless the pages `held` (by each owner) are exactly the used ones."""
        held = [p for pages in held for p in pages]
        assert len(held) == len(set(held)), "a host page has two owners"
        assert len(held) <= self.num_pages, "the host pool is over its bound"
        assert set(held) == {p for p, u in enumerate(self._used) if u}, "host pages held and used differ"
        assert len(self._free) == len(set(self._free)) == self.num_pages - len(held), "host free list is off"
