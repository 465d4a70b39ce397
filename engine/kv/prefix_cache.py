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

With layer groups (engine/kv/kv_groups.py) each group keeps its own chain of cached pages (its first page's
parent is -1 - group), and a prompt maps the leading pages every group holds. The host tier serves a model of one
group only (KVGroups.for_engine).

The pages, their keys and the evictable set are the PageAllocator's (engine/kv/page_allocator.py); the host tier's
entries are the Swapper's. The KV cache manager calls `map_cached` for a sequence it admits, then `page_in` (admitted
or staged, engine/kv/staging.py) or `unmap` (it does not fit), `recache` once a staged sequence's page-ins have
landed, and `cache_pages` for every chunk it schedules.
"""

from __future__ import annotations

from engine.kv.kv_cache_config import KVCacheConfig
from engine.kv.kv_groups import NONE, held
from engine.kv.page_allocator import PageAllocator, PageKey, page_key
from engine.scheduling.sequence import Sequence
from engine.kv.swap import Swapper


class PrefixCache:
    def __init__(self, config: KVCacheConfig, allocator: PageAllocator, swapper: Swapper) -> None:
        self.config = config
        self.allocator = allocator
        self.swapper = swapper

    def _key(self, pages: list[int], token_ids: list[int], i: int, group: int) -> PageKey | None:
        """The key to cache page i of a group's pages under, None when its chain is broken: the page before it was
        given back, or is no longer cached (a sliding group's page reclaimed before it, see page_allocator.py)."""
        if i and (pages[i - 1] == NONE or not self.allocator.is_cached(pages[i - 1])):
            return None
        return page_key(pages, token_ids, i, self.config.page_size, group)

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
        seq.pages = self.allocator.lookup_chain(seq.token_ids, end, ps, self.config.layer_groups.num_groups)
        parent = self.allocator.uid(seq.pages[0][-1]) if seq.num_pages else -1
        hits = self.swapper.host_hits(parent, seq.token_ids, seq.num_pages, end)
        seq.num_cached_pages = seq.num_pages
        seq.num_computed = (seq.num_pages + len(hits)) * ps
        return seq.num_computed, hits

    def page_in(self, seq: Sequence, hits: list[int], ahead: bool = False) -> None:
        """Page the host tier's pages `map_cached` found into the sequence's pages after its device hits (its
        computed tokens count them already), and cache them there again under their uids; `ahead`: stage the
        sequence, caching them when they have landed (`recache`, at the next step)."""
        if not hits:
            return
        start = seq.num_cached_pages
        (pages,) = seq.pages  # one group (the host tier's)
        self.swapper.page_in_hits(hits, pages[start:start + len(hits)], ahead)
        if ahead:
            seq.staged, seq.staged_hits = True, hits
        else:
            self.recache(seq, hits)

    def recache(self, seq: Sequence, hits: list[int]) -> None:
        """Cache the host tier's pages paged in to the sequence's pages after its cached ones under their uids."""
        if not hits:
            return
        (pages,) = seq.pages  # one group (the host tier's)
        for i, uid in enumerate(hits, seq.num_cached_pages):
            key = self._key(pages, seq.token_ids, i, 0)
            if seq.caching and key is not None and self.allocator.cache(pages[i], key, uid):
                seq.num_cached_pages += 1
            else:  # not cached again (a forked sample that could not fork): the entries after it are unreachable
                seq.caching = False
                self.swapper.host.free(self.swapper.cache.drop_descendants(uid))

    def unmap(self, seq: Sequence, hits: list[int]) -> None:
        """Undo `map_cached` for a sequence that cannot be admitted now."""
        self.swapper.release_hits(hits)
        self.allocator.free(held(seq.pages))
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
            for g, pages in enumerate(seq.pages):
                key = self._key(pages, seq.token_ids, i, g)
                if pages[i] == NONE or key is None or not self.allocator.cache(pages[i], key):
                    seq.caching = False  # the groups before this one keep page i cached: each chain is whole
                    return
            seq.num_cached_pages += 1

