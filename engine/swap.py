"""Swap preemption (`engine.preemption`): where a preempted sequence's pages go instead of being dropped. No JAX.

Part of the scheduler: it owns the host pool's bookkeeping (a HostPageAllocator) and acts on the scheduler's
PageAllocator when the scheduler asks, nothing else calls either. A swapped-out sequence's pages holding
computed tokens are copied to host pages, and all its pages are freed (it keeps none: a page kept mapped while
it waits could leave the sequence at the head of the queue without room, with nothing running to free any).
When it is admitted again, each page it had is, in order, found again in the prefix cache (a cached page of
its prompt still on the device, shared with others or not) or paged back in from the host; its computed tokens
are then the same, and nothing is recomputed.

The copies are the runner's: a step's SchedulerOutput lists the page-outs (run before the step, which may reuse
the freed pages) and then the page-ins. Within one step every swap-out (a running sequence preempted) is decided
before any swap-in (a waiting sequence admitted), so a host page freed by a page-in is never written in the same
step. Every decision depends only on the requests and their order: every host of a slice decides the same.
"""

from __future__ import annotations

from engine.capacity import pages_for
from engine.config import EngineConfig
from engine.page_allocator import HostPageAllocator, PageAllocator, page_key
from engine.sequence import Sequence, SwappedPages


class Swapper:
    def __init__(self, config: EngineConfig, allocator: PageAllocator) -> None:
        self.config = config
        self.allocator = allocator
        self.host = HostPageAllocator(config.host_kv_pages)
        self.pages_out = self.pages_in = 0  # pages copied each way, since the engine started
        self.avoided_tokens = 0  # computed tokens of sequences swapped back in (not recomputed)
        self.num_swaps = self.num_fallbacks = 0  # preemptions that swapped; those that found the host pool full
        self._clear_ops()

    def _clear_ops(self) -> None:
        self._out: tuple[list[int], list[int]] = ([], [])
        self._in: tuple[list[int], list[int]] = ([], [])
        self._avoided = 0

    def take_ops(self) -> dict:
        """The copies decided since the last call, and their count of tokens not recomputed, as SchedulerOutput
        fields: they go with the next device call, before it (its pages may be the ones a swap-out freed)."""
        ops = dict(swap_out=self._out, swap_in=self._in, swap_avoided_tokens=self._avoided)
        self._clear_ops()
        return ops

    def reset(self) -> None:
        self.host.reset()
        self._clear_ops()

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
        host = self.host.allocate(kept)
        if host is None:
            self.num_fallbacks += 1
            return False
        assert not self._in[0], "a swap-out decided after a swap-in of the same device call"
        self._out[0].extend(seq.pages[:kept])
        self._out[1].extend(host)
        self.allocator.free(seq.pages)
        seq.swapped = SwappedPages(host, seq.num_cached_pages)
        seq.pages = []
        self.pages_out += kept
        self.num_swaps += 1
        return True

    def recompute_is_cheap(self, seq: Sequence) -> bool:
        """`auto`'s rule: a recompute computes again only what the prefix cache cannot serve (its cached prompt
        pages stay findable on the device), so it is cheap when that is less than one page of tokens: a copy
        would then move more than a recompute computes."""
        served = seq.num_cached_pages * self.config.page_size if self.config.prefix_caching else 0
        return seq.num_computed - served < self.config.page_size

    def swap_in(self, seq: Sequence, num_tokens: int) -> bool:
        """Map a swapped-out sequence's pages again, with pages for `num_tokens` more tokens; False (nothing
        changed) when the device pool cannot hold them now."""
        st, ps = seq.swapped, self.config.page_size
        found: list[int] = []  # the leading cached prompt pages still on the device: no copy needed
        while len(found) < st.num_cached_pages and self.config.prefix_caching:
            page = self.allocator.lookup(page_key(found, seq.token_ids, len(found), ps))
            if page is None:
                break
            self.allocator.share([page])
            found.append(page)
        missing = st.host[len(found):]
        short = max(0, pages_for(seq.num_computed + num_tokens, ps) - len(st.host))
        new = self.allocator.allocate(len(missing) + short)
        if new is None:
            self.allocator.free(found)
            return False
        self._in[0].extend(missing)
        self._in[1].extend(new[:len(missing)])
        self.host.free(st.host)
        seq.pages = found + new
        seq.num_cached_pages = len(found)
        # Pages past the ones found again are copies: a page of the prompt's cache chain is not cached twice.
        seq.caching = seq.caching and len(found) == st.num_cached_pages
        seq.swapped = None
        self.pages_in += len(missing)
        self.avoided_tokens += seq.num_computed
        self._avoided += seq.num_computed
        return True
