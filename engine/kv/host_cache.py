"""The prefix cache's host tier: cached prompt pages the device reclaimed, kept in the host pool. No JAX.

When the device allocator reclaims cached pages (its evictable LRU set, engine/kv/page_allocator.py), the swapper
copies them to host pages and records them here; a later prompt whose prefix reaches such a page pages it back
in instead of computing it again (engine/kv/prefix_cache.py, at admission). Bookkeeping only: the data is the runner's
(KVCache's host pool). The swapper (part of the KV cache manager) records and pages in entries; the prefix cache's
`recache` drops an entry's descendants, and the scheduler's invariant check reads it.

A host entry is keyed `(parent uid, token ids)`: the uid (engine/kv/page_allocator.py) of the page holding the
prompt's previous page, on the device or here, -1 for the first page. A device page number is reused once
reclaimed, so it cannot name a parent here; a uid is never reused. An entry is reachable only through its
parent, so an entry whose parent leaves both tiers is dropped with it (`drop_descendants`).

The host pool is shared with swap preemption (engine/kv/swap.py) under one bound, engine.host_kv_pages: a
swapped-out sequence's pages are the only copy of its KV, a cached page is a copy of what a prompt can compute
again, so a swap-out takes the least recently used entries' pages when the pool is full, and a spill takes only
free pages or older entries', never a swapped sequence's. Entries being paged in are pinned: not evicted.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class HostEntry:
    parent: int  # the parent page's uid, -1 for a prompt's first page
    tokens: tuple[int, ...]
    host_page: int


class HostPrefixCache:
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._entries: dict[int, HostEntry] = {}  # uid -> entry
        self._uid_of: dict[tuple[int, tuple[int, ...]], int] = {}  # (parent uid, tokens) -> uid
        self._children: dict[int, set[int]] = {}  # uid (either tier) -> uids of the entries naming it as parent
        self._lru: OrderedDict[int, None] = OrderedDict()  # unpinned entries, least recently used first

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, uid: int) -> bool:
        return uid in self._entries

    @property
    def num_evictable(self) -> int:
        """Entries not pinned: their pages can be taken back for other uses."""
        return len(self._lru)

    def host_pages(self) -> list[int]:
        return [e.host_page for e in self._entries.values()]

    def lookup(self, parent: int, tokens: tuple[int, ...]) -> int | None:
        """The uid of the entry holding the page `tokens` after the page `parent`, or None."""
        return self._uid_of.get((parent, tokens))

    def drop_key(self, parent: int, tokens: tuple[int, ...]) -> list[int]:
        """Drop the entry under this key, if any, and its descendants; their host pages. A page spilled under a
        key held here already replaces that entry: the device computed it again (a prompt's last full page,
        computed for its logits, is never looked up)."""
        uid = self._uid_of.get((parent, tokens))
        if uid is None or uid not in self._lru:  # absent, or pinned (never: a pinned key is being paged in)
            return []
        self._children[parent].discard(uid)
        if not self._children[parent]:
            del self._children[parent]
        return self._drop_subtree(uid)

    def add(self, uid: int, parent: int, tokens: tuple[int, ...], host_page: int) -> None:
        """Record a spilled page (its data copied to `host_page`), the most recently used."""
        assert uid not in self._entries and (parent, tokens) not in self._uid_of, f"uid {uid} is on the host already"
        self._entries[uid] = HostEntry(parent, tokens, host_page)
        self._uid_of[(parent, tokens)] = uid
        self._children.setdefault(parent, set()).add(uid)
        self._lru[uid] = None

    def pin(self, uid: int) -> None:
        del self._lru[uid]

    def unpin(self, uid: int) -> None:
        self._lru[uid] = None  # most recently used: a prompt just asked for it

    def take(self, uid: int) -> int:
        """Remove a pinned entry being paged in (its page is cached on the device again under the same uid,
        so its children stay reachable); its host page, which the caller frees."""
        e = self._entries.pop(uid)
        del self._uid_of[(e.parent, e.tokens)]
        self._children[e.parent].discard(uid)
        if not self._children[e.parent]:
            del self._children[e.parent]
        return e.host_page

    def evict_lru(self, protect: set[int] = frozenset()) -> list[int] | None:
        """Drop the least recently used entry and its descendants; their host pages, or None when there is
        none or it is in `protect` (entries just added that a caller still chains from)."""
        if not self._lru:
            return None
        uid = next(iter(self._lru))
        if uid in protect:
            return None
        e = self._entries[uid]
        self._children[e.parent].discard(uid)
        if not self._children[e.parent]:
            del self._children[e.parent]
        return self._drop_subtree(uid)

    def drop_descendants(self, uid: int) -> list[int]:
        """Drop the entries descending from `uid`, a page leaving both tiers (unreachable now); their host pages."""
        return [p for child in self._children.pop(uid, ()) for p in self._drop_subtree(child)]

    def _drop_subtree(self, uid: int) -> list[int]:
        pages, stack = [], [uid]
        while stack:
            u = stack.pop()
            e = self._entries.pop(u)
            del self._uid_of[(e.parent, e.tokens)]
            self._lru.pop(u, None)
            pages.append(e.host_page)
            stack.extend(self._children.pop(u, ()))
        return pages

    def check(self) -> None:
        """Raise AssertionError if the entries, their keys, children and LRU order disagree."""
        assert len(self._uid_of) == len(self._entries), "a key maps to no entry"
        for uid, e in self._entries.items():
            assert self._uid_of[(e.parent, e.tokens)] == uid, f"entry {uid}'s key maps elsewhere"
            assert uid in self._children.get(e.parent, ()), f"entry {uid} is not among its parent's children"
        assert all(u in self._entries for kids in self._children.values() for u in kids), "a child is gone"
        assert set(self._lru) <= set(self._entries), "an LRU uid has no entry"
        pages = self.host_pages()
        assert len(pages) == len(set(pages)), "two entries hold one host page"
