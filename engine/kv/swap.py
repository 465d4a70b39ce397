"""Swap preemption (`engine.preemption`): where a preempted sequence's pages go instead of being dropped. No JAX.

Part of the KV cache manager (engine/kv/kv_cache_manager.py): it owns the host pool's bookkeeping (a
HostPageAllocator) and acts on the manager's PageAllocator when the manager asks, nothing else calls either. A
swapped-out sequence's pages holding computed tokens are copied to host pages, and all its pages are freed (it
keeps none: a page kept mapped while it waits could leave the sequence at the head of the queue without room,
with nothing running to free any).
When it is admitted again, each page it had is, in order, found again in the prefix cache (a cached page of
its prompt still on the device, shared with others or not) or paged back in from the host; its computed tokens
are then the same, and nothing is recomputed.

It also runs the prefix cache's host tier (engine/kv/host_cache.py, with engine.prefix_caching and a host pool):
the cached pages the device allocator reclaims are spilled to host pages (`_spill`, its `on_evict`), and an
admitted prompt whose prefix continues there pages them back in (`host_hits`, `page_in_hits`). The host pool's
one bound covers both; host_cache.py says how they share it.

Staging (page-ins a step ahead): a sequence whose pages must be paged in, admitted while other sequences run
the step, is staged instead: its device pages are mapped and its page-ins issued with this step (`swap_in` and
`page_in_hits` with `ahead`: the SchedulerOutput's `swap_in_ahead`), so the copies run behind this step's
compute; it stays at its place in the queue and is admitted in a later step (`admit`), the first that reads
the pages. A staged swapped-out sequence keeps its host pages until then. With nothing else to run, or no
room to stage (engine/kv/staging.py), a page-in is issued in the step that needs it.

The copies are the runner's: a step's SchedulerOutput lists the page-outs (run before the step, which may reuse
the freed pages) and then the page-ins. A host page a page-in reads is freed only when the step's copies are
handed over (`take_ops`), so no page-out of the same step writes it; a device page a page-in writes is mapped
by the sequence admitted with it, so no page-out of the same step reads it. Every decision depends only on the
requests and their order: every host of a slice decides the same.
"""

from __future__ import annotations

from engine.sizing.capacity import pages_for
from engine.kv.kv_cache_config import KVCacheConfig
from engine.kv.host_cache import HostPrefixCache
from engine.kv.kv_groups import NONE, held
from engine.kv.page_allocator import EvictedPage, HostPageAllocator, PageAllocator
from engine.scheduling.sequence import Sequence, SwappedPages


class Swapper:
    def __init__(self, config: KVCacheConfig, allocator: PageAllocator) -> None:
        self.config = config
        self.allocator = allocator
        # Units of every group (engine/kv/kv_groups.py): host_kv_pages pages of every layer.
        self.host = HostPageAllocator(config.layer_groups.units(config.host_kv_pages))
        self.cache = HostPrefixCache()  # the prefix cache's host tier (one group only: KVGroups.for_engine)
        self.tiered = config.prefix_caching and config.host_kv_pages > 0 and config.layer_groups.num_groups == 1
        if self.tiered:
            allocator.on_evict = self._spill
        self.pages_out = self.pages_in = 0  # pages copied each way, since the engine started
        self.pages_in_ahead = 0  # of the pages in, those issued a step ahead of the step reading them (staged)
        self.avoided_tokens = 0  # computed tokens whose KV was paged back in (swapped sequences, cached prefixes)
        self.num_swaps = self.num_fallbacks = 0  # preemptions that swapped; those that found the host pool full
        self._releasing: list[int] = []  # host pages read by this step's page-ins: freed at `take_ops`
        self._clear_ops()

    @property
    def releasing(self) -> list[int]:
        """Host pages this step's page-ins read: still taken until `take_ops` hands the copies over."""
        return list(self._releasing)

    def _clear_ops(self) -> None:
        self._out: tuple[list[int], list[int]] = ([], [])
        self._in: tuple[list[int], list[int]] = ([], [])
        self._in_ahead: tuple[list[int], list[int]] = ([], [])  # page-ins of sequences staged this step
        self._avoided = 0

    def take_ops(self) -> dict:
        """The copies decided since the last call, and their count of tokens not recomputed, as SchedulerOutput
        fields: they go with the next device call, before it (its pages may be the ones a swap-out freed)."""
        # A host page written twice (spilled, evicted and written again in one step) keeps its last copy only.
        last = {h: i for i, h in enumerate(self._out[1])}
        keep = sorted(last.values())
        out = ([self._out[0][i] for i in keep], [self._out[1][i] for i in keep])
        self.pages_out -= len(self._out[0]) - len(keep)
        ops = dict(swap_out=out, swap_in=self._in, swap_in_ahead=self._in_ahead, swap_avoided_tokens=self._avoided)
        self.host.free(self._releasing)
        self._releasing = []
        self._clear_ops()
        return ops

    def reset(self, keep_cache: bool = False) -> None:
        """Forget swapped sequences (none is left); `keep_cache` keeps the host tier's pages."""
        if keep_cache:
            self.host.free(self._releasing)
            kept = set(self.cache.host_pages())
            self.host.free([p for p in range(self.host.num_pages) if self.host.is_used(p) and p not in kept])
        else:
            self.host.reset()
            self.cache.reset()
        self._releasing = []
        self._clear_ops()

    def _host_pages(self, num: int, protect: set[int] = frozenset()) -> list[int] | None:
        """`num` free host pages, evicting the host tier's least recently used entries for them (never those in
        `protect`); None (nothing taken) when even that does not free enough: nothing is evicted then, unless the
        least recently used entry is protected, which stops the evictions where they are."""
        if num > self.host.num_pages - self.host.num_used + self.cache.num_evictable:
            return None
        while self.host.num_pages - self.host.num_used < num:
            dropped = self.cache.evict_lru(protect)
            if dropped is None:
                return None
            self.host.free(dropped)
        return self.host.allocate(num)

    def swap_out(self, seq: Sequence) -> bool:
        """Swap a sequence being preempted (it has left the running set) out, or answer False (it recomputes):
        preemption `recompute`, nothing computed, `auto` and a cheap recompute (`recompute_is_cheap`), or a host
        pool without room (a fallback)."""
        mode = self.config.preemption
        if self.host.num_pages == 0 or mode == "recompute" or seq.num_computed == 0:
            return False
        if mode == "auto" and self.recompute_is_cheap(seq):
            return False
        kept = pages_for(seq.num_computed, self.config.page_size)
        out = [[p for p in pages[:kept]] for pages in seq.pages]  # the pages holding computed tokens
        host = self._host_pages(len(held(out)))
        if host is None:
            self.num_fallbacks += 1
            return False
        self._out[0].extend(held(out))
        self._out[1].extend(host)
        it = iter(host)
        self.allocator.free(held(seq.pages))
        seq.swapped = SwappedPages([[NONE if p == NONE else next(it) for p in pages] for pages in out],
                                   seq.num_cached_pages)
        seq.pages = []
        self.pages_out += len(host)
        self.num_swaps += 1
        return True

    def recompute_is_cheap(self, seq: Sequence) -> bool:
        """`auto`'s rule: a recompute computes again only what the prefix cache cannot serve (its cached prompt
        pages stay findable on the device), so it is cheap when that is less than one page of tokens: a copy
        would then move more than a recompute computes."""
        served = seq.num_cached_pages * self.config.page_size if self.config.prefix_caching else 0
        return seq.num_computed - served < self.config.page_size

    def swap_in(self, seq: Sequence, num_tokens: int, ahead: bool = False) -> bool:
        """Map a swapped-out sequence's pages again, with pages for `num_tokens` more tokens, and admit it; False
        (nothing changed) when the device pool cannot hold them now. `ahead`: stage it instead (its computed
        tokens' pages only; `admit` later)."""
        st, ps = seq.swapped, self.config.page_size
        # The leading cached prompt pages still on the device: no copy needed.
        found = (self.allocator.lookup_chain(seq.token_ids, st.num_cached_pages, ps, len(st.host))
                 if self.config.prefix_caching else [])
        num_found = len(found[0]) if found else 0
        # Per group, the pages after those found, NONE before the window of the next token (not paged in: a page
        # given back now could be reused by a sequence this step while its copy lands at the next).
        groups = self.config.layer_groups
        first = [groups.first_needed(g, seq.num_computed, ps) for g in range(len(st.host))]
        missing = [[NONE if i < first[g] else h for i, h in enumerate(pages) if i >= num_found]
                   for g, pages in enumerate(st.host)]
        short = 0 if ahead else max(0, pages_for(seq.num_computed + num_tokens, ps) - len(st.host[0]))
        new = self.allocator.allocate(len(held(missing)) + short * len(st.host))
        if new is None:
            self.allocator.free(held(found))
            return False
        ops = self._in_ahead if ahead else self._in
        ops[0].extend(held(missing))
        ops[1].extend(new[:len(held(missing))])
        it = iter(new)
        pages = [(found[g] if found else []) + [NONE if h == NONE else next(it) for h in group]
                 for g, group in enumerate(missing)]
        for group in pages:
            group.extend(next(it) for _ in range(short))
        seq.pages = pages
        seq.num_cached_pages = num_found
        self.pages_in += len(held(missing))
        if ahead:
            self.pages_in_ahead += len(held(missing))
            seq.staged = True
        else:
            self.admit(seq)
        return True

    def admit(self, seq: Sequence) -> None:
        """A swapped-out sequence whose pages are mapped again runs: its host pages go (once this step's copies
        are handed over), and its computed tokens were not recomputed."""
        st = seq.swapped
        self._releasing.extend(held(st.host))
        # Pages past the ones found again are copies: a page of the prompt's cache chain is not cached twice.
        seq.caching = seq.caching and seq.num_cached_pages == st.num_cached_pages
        seq.swapped, seq.staged = None, False
        self.avoided_tokens += seq.num_computed
        self._avoided += seq.num_computed

    # -- the prefix cache's host tier --------------------------------------------------------------

    def _spill(self, evicted: list[EvictedPage]) -> None:
        """The device allocator reclaims these cached pages (parents first): copy each to a host page, as the
        most recently used entries, while the pool has room (free, or older entries' pages); a page that finds
        none is dropped with every entry descending from it."""
        added: set[int] = set()
        for i, (page, parent, tokens, uid) in enumerate(evicted):
            self.host.free(self.cache.drop_key(parent, tokens))
            # The first page's parent stays cached on the device; a later one's must have been spilled here.
            chained = (i == 0 or parent in added) and self.cache.lookup(parent, tokens) is None
            host = self._host_pages(1, protect=added) if chained else None
            if host is None:
                self.host.free(self.cache.drop_descendants(uid))
                continue
            self.cache.add(uid, parent, tokens, host[0])
            added.add(uid)
            self._out[0].append(page)
            self._out[1].append(host[0])
            self.pages_out += 1

    def host_hits(self, parent: int, token_ids: list[int], start: int, end: int) -> list[int]:
        """The host tier's entries for a prompt's pages start, start + 1, ... (below `end`), following on the
        page whose uid is `parent`: their uids, pinned (not evicted) until `page_in_hits` or `release_hits`."""
        if not self.tiered:
            return []
        ps, hits = self.config.page_size, []
        for i in range(start, end):
            uid = self.cache.lookup(parent, tuple(token_ids[i * ps:(i + 1) * ps]))
            if uid is None:
                break
            self.cache.pin(uid)
            hits.append(uid)
            parent = uid
        return hits

    def release_hits(self, hits: list[int]) -> None:
        """Unpin the entries of `host_hits` (the prompt was not admitted)."""
        for uid in hits:
            self.cache.unpin(uid)

    def page_in_hits(self, hits: list[int], device_pages: list[int], ahead: bool = False) -> None:
        """Page the entries of `host_hits` back in to `device_pages` (the caller caches them there again, once
        they land: a step later when `ahead`, a sequence staged)."""
        ops = self._in_ahead if ahead else self._in
        for uid, page in zip(hits, device_pages):
            host = self.cache.take(uid)
            self._releasing.append(host)
            ops[0].append(host)
            ops[1].append(page)
        self.pages_in += len(hits)
        self.pages_in_ahead += len(hits) if ahead else 0
        self.avoided_tokens += len(hits) * self.config.page_size
        self._avoided += len(hits) * self.config.page_size
