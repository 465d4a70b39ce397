"""The prefix cache at admission (`engine.prefix_caching`): which cached pages a sequence maps, which it pages in
from the host tier, and which of its computed prompt pages it caches. Part of the KV cache manager
(engine/kv/kv_cache_manager.py). No JAX here.

A sequence being admitted maps the cached pages of its prompt's leading full pages and computes only the rest;
a full prompt page is cached as soon as the step that computes it is scheduled. A later sequence of the same
step may map it: each layer writes the step's new K/V into the pool before any attention reads it. Cached
pages outlive their sequences (the allocator reclaims them when pages run out), so a prompt preempted or sent
again later finds its prefix too. With a host pool, reclaimed cached pages spill to the host tier
(engine/kv/swap.py, engine/kv/host_cache.py): a prompt whose prefix continues there pages those pages back in before
its step instead of computing them. Which pages are cached depends only on the requests and their order, so
every host of a slice decides the same.

The pages, their keys and the evictable set are the PageAllocator's (engine/kv/page_allocator.py); the host tier's
entries are the Swapper's. The KV cache manager calls `map_cached` for a sequence it admits, then `page_in` (admitted
or staged, engine/kv/staging.py) or `unmap` (it does not fit), `recache` once a staged sequence's page-ins have
landed, and `cache_pages` for every chunk it schedules.
"""

from __future__ import annotations

from engine.kv.kv_cache_config import KVCacheConfig
from engine.kv.page_allocator import PageAllocator, PageKey, page_key
from engine.scheduling.sequence import Sequence
from engine.kv.swap import Swapper


class PrefixCache:
    def __init__(self, config: KVCacheConfig, allocator: PageAllocator, swapper: Swapper) -> None:
        self.config = config
        self.allocator = allocator
        self.swapper = swapper

    def _page_key(self, seq: Sequence, i: int) -> PageKey:
        return page_key(seq.pages, seq.token_ids, i, self.config.page_size)

    def map_cached(self, seq: Sequence) -> tuple[int, list[int]]:
        """Map the cached pages of a sequence's leading full prompt pages (it computes nothing yet), then find
        the pages after them in the host tier (pinned; `page_in` maps them once the sequence has its pages);
        the tokens both hold, and the host tier's uids. The last token is always computed: its logits pick the
        next token; so is every token whose logits score a prompt token (Request.first_scored)."""
        if not self.config.prefix_caching or seq.pages:
            return 0, []
        ps = self.config.page_size
        first = seq.request.first_scored
        end = min(seq.num_prompt_tokens, len(seq.token_ids) - 1, len(seq.token_ids) if first is None else first - 1) // ps
        for i in range(end):
            page = self.allocator.lookup(self._page_key(seq, i))
            if page is None:
                break
            self.allocator.share([page])
            seq.pages.append(page)
        parent = self.allocator.uid(seq.pages[-1]) if seq.pages else -1
        hits = self.swapper.host_hits(parent, seq.token_ids, len(seq.pages), end)
        seq.num_cached_pages = len(seq.pages)
        seq.num_computed = (len(seq.pages) + len(hits)) * ps
        return seq.num_computed, hits

    def page_in(self, seq: Sequence, hits: list[int], ahead: bool = False) -> None:
        """Page the host tier's pages `map_cached` found into the sequence's pages after its device hits (its
        computed tokens count them already), and cache them there again under their uids; `ahead`: stage the
        sequence, caching them when they have landed (`recache`, at the next step)."""
        start = seq.num_cached_pages
        self.swapper.page_in_hits(hits, seq.pages[start:start + len(hits)], ahead)
        if ahead:
            seq.staged, seq.staged_hits = True, hits
        else:
            self.recache(seq, hits)

    def recache(self, seq: Sequence, hits: list[int]) -> None:
        """Cache the host tier's pages paged in to the sequence's pages after its cached ones under their uids."""
        for i, uid in enumerate(hits, seq.num_cached_pages):
            if seq.caching and self.allocator.cache(seq.pages[i], self._page_key(seq, i), uid):
                seq.num_cached_pages += 1
            else:  # not cached again (a forked sample that could not fork): the entries after it are unreachable
                seq.caching = False
                self.swapper.host.free(self.swapper.cache.drop_descendants(uid))

    def unmap(self, seq: Sequence, hits: list[int]) -> None:
        """Undo `map_cached` for a sequence that cannot be admitted now."""
        self.swapper.release_hits(hits)
        self.allocator.free(seq.pages)
        seq.pages = []
        seq.num_computed = seq.num_cached_pages = 0

    def cache_pages(self, seq: Sequence, num_tokens: int) -> None:
        """Cache the full prompt pages this step's chunk of `num_tokens` completes (scheduled, so computed
        before any later step reads them, and written before any attention of this step reads them)."""
        if not self.config.prefix_caching:
            return
        end = min(seq.num_computed + num_tokens, seq.num_prompt_tokens) // self.config.page_size
        while seq.caching and seq.num_cached_pages < end:
            i = seq.num_cached_pages
            if not self.allocator.cache(seq.pages[i], self._page_key(seq, i)):
                seq.caching = False
                return
            seq.num_cached_pages += 1
