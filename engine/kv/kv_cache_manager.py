"""The KV cache manager: the one owner of the KV pages' bookkeeping, in front of the scheduler. No JAX here.

It alone holds the device page allocator (engine/kv/page_allocator.py), the prefix cache at admission
(engine/kv/prefix_cache.py), the host pool with swap preemption and the prefix cache's host tier (engine/kv/swap.py,
engine/kv/host_cache.py) and the sequences staged for page-ins a step ahead (engine/kv/staging.py). The scheduler
decides which sequences run; it asks this manager for their pages through a small API and never touches a
page list's allocator itself:

- `allocate(seq, num_tokens)`: pages for the sequence's next `num_tokens` tokens, or False (nothing taken):
  the scheduler preempts or waits; running out is an answer, not an error. `reserve` does the same for
  several sequences at once (multi-step decode calls), all or nothing.
- `free(seq)`: give its pages back (finished or preempted without a swap).
- `map_cached` / `unmap` / `page_in` / `cache_pages`: the prefix cache for a sequence being admitted and for
  every chunk scheduled.
- `swap_out` / `swap_in` / `stage` / `admit_staged`: the host tier for a preempted sequence, and the
  page-ins issued a step ahead.
- `fork(parent, sibling)`: a sample of a prompt shares its parent's full prompt pages and gets a copy of the
  partial last one.
- `take_copies()`: every page copy decided since the last call (`KVCopies`), which the runner executes
  with the next device call: page-outs, then page-ins, then the page-ins issued ahead; the forks' copies after
  the step.

Layer groups (engine/kv/kv_groups.py, vLLM v1's hybrid KV cache manager): each group of layers of one attention kind
has its own page table, and a sequence one page list per group (`Sequence.pages`). The allocator's pages are the
groups' units, any group using any; a new page of a sequence is one unit in every group. Before it allocates for
a sequence, the manager gives back the pages of its sliding groups that every position it will still compute has
left the window of (`release`): such a group holds a window's pages, not the sequence's. The prefix cache keeps a
chain per group (engine/kv/prefix_cache.py); the host pool's copies (swap, the host tier) move units too. The
scheduler's calls keep their shape: it asks for tokens, not pages, and gets yes or no.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.kv.kv_cache_config import KVCacheConfig
from engine.kv.kv_groups import NONE, held
from engine.kv.page_allocator import PageAllocator
from engine.kv.prefix_cache import PrefixCache
from engine.scheduling.sequence import Sequence
from engine.kv.staging import Staging
from engine.kv.swap import Swapper


@dataclass(frozen=True)
class KVCopies:
    """The page copies one device call carries, as (source pages, destination pages) pairs: `swap_out` (device
    to host) before the call, then `swap_in` (host to device); `swap_in_ahead` (host to device) start before
    the call and land before the next one; `copies` (device to device, forked samples' partial last pages)
    after it. `swap_avoided_tokens`: computed tokens paged back in now, not recomputed."""

    swap_out: tuple[list[int], list[int]] = ((), ())
    swap_in: tuple[list[int], list[int]] = ((), ())
    swap_in_ahead: tuple[list[int], list[int]] = ((), ())
    copies: tuple[list[int], list[int]] = ((), ())
    swap_avoided_tokens: int = 0


class KVCacheManager:
    def __init__(self, config: KVCacheConfig) -> None:
        self.config = config
        self.groups = config.layer_groups
        self._sliding = [g for g, w in enumerate(self.groups.windows) if w is not None]  # groups that give pages back
        self.allocator = PageAllocator(self.groups.units(config.max_pages))
        self.swapper = Swapper(config, self.allocator)  # the host pool: swap preemption and the host tier
        self.prefix = PrefixCache(config, self.allocator, self.swapper)
        self.staging = Staging(config.page_size, self.allocator, self.groups.num_groups)
        self._copies: tuple[list[int], list[int]] = ([], [])  # forks' copies decided since `take_copies`

    # -- pages for a step ------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return self.allocator.num_free

    @property
    def num_used(self) -> int:
        return self.allocator.num_used

    def release(self, seq: Sequence) -> None:
        """Give back the pages of the sequence's sliding groups that lie wholly before the window of its next
        token to compute (no later query sees them); they stay cached (evictable) when the prefix cache holds them.
        The scheduler calls it after every step, and this manager before it allocates or swaps."""
        ps = self.config.page_size
        for g in self._sliding if seq.pages else ():
            pages = seq.pages[g]
            end = min(self.groups.first_needed(g, seq.num_computed, ps), len(pages))
            gone = [p for p in pages[:end] if p != NONE]
            if gone:
                self.allocator.free(gone)
                pages[:end] = [NONE] * end

    def _extend(self, seq: Sequence, units: list[int]) -> None:
        """Add the same number of new pages to each of the sequence's groups, from `units`."""
        num = len(units) // self.groups.num_groups
        if not seq.pages:
            seq.pages = [[] for _ in range(self.groups.num_groups)]
        for g, pages in enumerate(seq.pages):
            pages.extend(units[g * num:(g + 1) * num])

    def allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Pages for `num_tokens` tokens past the sequence's computed ones, or False (nothing taken)."""
        self.release(seq)
        units = self.allocator.allocate(seq.pages_short(num_tokens, self.config.page_size) * self.groups.num_groups)
        if units is None:
            return False
        self._extend(seq, units)
        return True

    def reserve(self, seqs: list[Sequence], num_pages: list[int]) -> bool:
        """`num_pages[i]` more pages (of each group) for each `seqs[i]`, all of them or none (False)."""
        for seq in seqs:
            self.release(seq)
        G = self.groups.num_groups
        if sum(num_pages) * G > self.allocator.num_free:
            return False
        for seq, n in zip(seqs, num_pages):
            if n:
                self._extend(seq, self.allocator.allocate(n * G))
        return True

    def free(self, seq: Sequence) -> None:
        """Give the sequence's pages back (cached ones stay cached, evictable)."""
        self.allocator.free(held(seq.pages))
        seq.pages = []

    def fork(self, parent: Sequence, sibling: Sequence) -> bool:
        """Map the parent's full prompt pages for a sibling and give it a page for a copy (made after this step)
        of the parent's partial last prompt page; False (nothing taken) when no page is free for that copy."""
        ps, G = self.config.page_size, self.groups.num_groups
        num_full = parent.num_prompt_tokens // ps
        partial = parent.num_prompt_tokens % ps != 0
        own = self.allocator.allocate(G) if partial else []
        if own is None:
            return False
        shared = [pages[:num_full] for pages in parent.pages]
        self.allocator.share(held(shared))
        sibling.pages = [pages + own[g:g + 1] for g, pages in enumerate(shared)]
        if partial:
            self._copies[0].extend(pages[num_full] for pages in parent.pages)
            self._copies[1].extend(own)
        return True

    # -- the prefix cache at admission -----------------------------------------------------------

    def map_cached(self, seq: Sequence) -> tuple[int, list[int]]:
        """Map the cached pages of a sequence's prompt (see PrefixCache.map_cached): the tokens they hold, and
        the host tier's entries that continue them (pinned until `page_in` or `unmap`)."""
        return self.prefix.map_cached(seq)

    def unmap(self, seq: Sequence, hits: list[int]) -> None:
        self.prefix.unmap(seq, hits)

    def page_in(self, seq: Sequence, hits: list[int], ahead: bool) -> None:
        """Page the host tier's `hits` in to the sequence's pages; `ahead`: stage it (`stage`)."""
        self.prefix.page_in(seq, hits, ahead)

    def cache_pages(self, seq: Sequence, num_tokens: int) -> None:
        self.prefix.cache_pages(seq, num_tokens)

    # -- the host tier, staging --------------------------------------------------------------------

    def swap_out(self, seq: Sequence) -> bool:
        """A sequence leaving the running set: its pages go to the host pool (True), or are freed (False; its
        tokens are recomputed later, so its computed count is 0 again)."""
        self.release(seq)  # pages slid out since its last allocation: not copied
        if self.swapper.swap_out(seq):
            return True
        self.free(seq)
        seq.num_computed = seq.num_cached_pages = 0
        seq.caching = True
        return False

    def swap_in(self, seq: Sequence, num_tokens: int, ahead: bool) -> bool:
        """Map a swapped-out sequence's pages again with room for `num_tokens` more (see Swapper.swap_in)."""
        if not self.swapper.swap_in(seq, num_tokens, ahead):
            return False
        self.release(seq)  # cached pages found again before its window
        return True

    def can_stage(self, seq: Sequence, num_pages: int) -> bool:
        return self.staging.has_room(seq, num_pages)

    def stage(self, seq: Sequence) -> None:
        self.staging.add(seq)

    def land_staged(self) -> None:
        """The page-ins of the staged sequences have landed (a step ran): cache the host tier's pages again."""
        for seq in self.staging.seqs:
            self.prefix.recache(seq, seq.staged_hits)
            seq.staged_hits = []

    def admit_staged(self, seq: Sequence) -> None:
        """A staged sequence runs now: it leaves staging (a swapped-out one gives its host pages back)."""
        self.staging.remove(seq)
        if seq.swapped is not None:
            self.swapper.admit(seq)
        seq.staged = False

    @property
    def staged(self) -> list[Sequence]:
        return self.staging.seqs

    def take_copies(self) -> KVCopies:
        """The copies decided since the last call: they go with the next device call (see KVCopies)."""
        ops = self.swapper.take_ops()
        copies, self._copies = self._copies, ([], [])
        return KVCopies(ops["swap_out"], ops["swap_in"], ops["swap_in_ahead"], copies, ops["swap_avoided_tokens"])

    # -- whole pool ------------------------------------------------------------------------------

    def reset(self, keep_cache: bool = False) -> None:
        """Forget every allocation (no sequence holds pages any more); `keep_cache` keeps the prefix cache's
        pages in both tiers."""
        self.staging.reset()
        if not keep_cache:
            self.allocator.reset()
        self.swapper.reset(keep_cache)
        self._copies = ([], [])

    def check(self, holders: list[Sequence], waiting: list[Sequence]) -> None:
        """Raise AssertionError unless the pages `holders` (and the staged sequences) map, the host pool's
        pages and both tiers of the prefix cache agree."""
        alloc, swapper = self.allocator, self.swapper
        alloc.check([held(s.pages) for s in holders + self.staging.seqs])
        self.staging.check(waiting)
        swapper.host.check([held(s.swapped.host) for s in waiting if s.swapped is not None]
                           + [swapper.cache.host_pages(), swapper.releasing])
        swapper.cache.check()
        on_device = {alloc.uid(p) for p in range(alloc.num_pages)} - {-1}
        assert not any(uid in swapper.cache for uid in on_device), "a cached page is in both tiers"
        for s in holders:
            assert all(alloc.refcount(p) >= 1 for p in held(s.pages))
            assert len({len(pages) for pages in s.pages}) <= 1 and len(s.pages) in (0, self.groups.num_groups)
            for g, pages in enumerate(s.pages):  # given back: a leading run of pages before the window, at most
                gone = pages.count(NONE)
                assert NONE not in pages[gone:], f"group {g}: a page given back after one held"
                assert gone <= self.groups.first_needed(g, s.num_computed, self.config.page_size), \
                    f"group {g}: a page inside the window was given back"

    @property
    def pages_in_use(self) -> int:
        """Pages' worth of every layer in use (the allocator counts units of its layer groups), rounded up."""
        return self.groups.as_pages(self.allocator.num_used)

    def snapshot(self) -> dict[str, int]:
        """The pool's counts (host-side state only), in pages of every layer (engine.max_pages' unit; with layer
        groups, the groups' units in use rounded up to pages, free ones down)."""
        alloc, swapper, pages = self.allocator, self.swapper, self.groups.as_pages
        return {"pages_in_use": self.pages_in_use, "free_pages": alloc.num_free // self.groups.num_groups,
                "max_refcount": alloc.max_refcount, "cached_pages": pages(alloc.num_cached),
                "host_kv_pages_in_use": pages(swapper.host.num_used),
                "num_swaps": swapper.num_swaps, "num_swap_fallbacks": swapper.num_fallbacks,
                "host_cached_pages": len(swapper.cache)}

    def stuck_message(self) -> str:
        return f"{self.allocator.num_free // self.groups.num_groups} of {self.config.max_pages} are free"

