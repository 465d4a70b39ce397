"""The scheduler: the one owner of pages and sequences. No JAX here.

It owns the `PageAllocator` (nothing else calls it), the sequences (waiting, running, finished but holding
pages) and the samples of one prompt that will fork from it, and decides each step in one
`SchedulerOutput`: a ragged step (prompt chunks and decode tokens, FIFO, within the token budget
`max_prefill_size`) or a multi-step decode call. There is no prefill phase: each sequence's computed-token
count catches up with its token count, which gives chunked prefill and mixed steps. Decoding sequences go
first, then prompt chunks; a slot freed by a finished sequence goes to the next waiting one in the same
step. Running out of pages is an answer, not a crash: the newest running sequence is preempted: its pages are
freed and its tokens recomputed later, or (engine.preemption, engine/swap.py) its pages go to the host pool and
come back when it is admitted again.

Prefix caching (`engine.prefix_caching`): a sequence being admitted maps the cached pages of its prompt's
leading full pages and computes only the rest; a full prompt page is cached as soon as the step that computes
it is scheduled. A later sequence of the same step may map it: each layer writes the step's new K/V into the
pool before any attention reads it. Cached pages outlive their sequences (the allocator reclaims them when
pages run out), so a prompt preempted or sent again later finds its prefix too. With a host pool, reclaimed
cached pages spill to the host tier (engine/swap.py, engine/host_cache.py): a prompt whose prefix continues
there pages those pages back in before its step instead of computing them. Which pages are cached
depends only on the requests and their order, so every host of a slice decides the same.

Page-ins a step ahead: a sequence that needs pages paged in (swapped out, or a prefix continuing in the host
tier), reached by admission while other sequences run the step, is staged (engine/swap.py): pages mapped,
page-ins issued with this step, admitted in a later one. A staged sequence keeps its place and its slot in the
queue, and its pages: it is staged only when the free pages cover its pages now and what every staged
sequence needs to grow into its next chunk, so when nothing else runs the first staged sequence can always be
admitted; otherwise it is admitted as before, its page-ins issued with the step that reads them.
"""

from __future__ import annotations

from collections import deque

from engine.capacity import pages_for
from engine.config import EngineConfig
from engine.page_allocator import PageAllocator, PageKey, page_key
from engine.scheduler_output import DecodeCall, ScheduledChunk, SchedulerOutput
from engine.sequence import Sequence
from engine.swap import Swapper


class Scheduler:
    def __init__(self, config: EngineConfig, max_seq_len: int) -> None:
        self.config = config
        self.max_seq_len = max_seq_len
        self.allocator = PageAllocator(config.max_pages)
        self.swapper = Swapper(config, self.allocator)  # swap preemption; owns the host pool's pages
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in arrival order
        self.retained: list[Sequence] = []  # finished, pages kept (cleanup_mode end / none)
        self._last_queued: Sequence | None = None  # the newest queued sequence, to group samples of one prompt
        # The rows of a multi-step call dispatched ahead (engine.pipeline_decode), not yet read by the host.
        self._ahead: list[Sequence] | None = None
        self.num_preemptions = 0
        self.num_multi_step_fallbacks = 0  # decode-only steps run singly because their pages were not free
        self.num_pipelined_calls = 0  # multi-step calls dispatched ahead
        self._cache_query_tokens = 0  # prompt tokens of sequences admitted with a cache lookup, this step
        self._cache_hit_tokens = 0  # of those, tokens whose KV the cache held
        self._recompute_tokens = 0  # computed tokens dropped by preemptions that did not swap, this step
        self._staged: list[Sequence] = []  # waiting sequences staged (their page-ins issued), oldest first

    # -- sequences ---------------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Queue a sequence; another sample of the newest queued prompt waits to fork from it instead."""
        head = self._last_queued
        # The newest queued sequence is still waiting (never admitted, nothing generated): O(1) to check,
        # so queueing a large batch stays linear.
        if (head is not None and head.num_computed == 0 and not head.pages
                and len(head.token_ids) == head.num_prompt_tokens and head not in self.running
                and head.request.prompt_id == seq.request.prompt_id
                and head.request.prompt_token_ids == seq.request.prompt_token_ids
                and 1 + len(head.siblings) + 1 <= self.config.max_seqs):
            head.siblings.append(seq)
            return
        self.waiting.append(seq)
        self._last_queued = seq

    @property
    def call_ahead(self) -> list[Sequence] | None:
        """The rows of the multi-step call dispatched ahead of the host's read (engine.pipeline_decode)."""
        return self._ahead

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def slots_in_use(self) -> int:
        """Running sequences plus the siblings they will fork into (their slots are reserved at admission)."""
        return len(self.running) + sum(len(s.siblings) for s in self.running)

    @property
    def head_has_slots(self) -> bool:
        """The first waiting sequence (with the siblings it will fork into) fits in the free slots now."""
        return bool(self.waiting) and self.slots_in_use + 1 + len(self.waiting[0].siblings) <= self.config.max_seqs

    def finish(self, seq: Sequence) -> None:
        """Take a finished sequence out of the running set; its pages go back now (cleanup_mode incremental)
        or at `release_finished` / reset."""
        self.running.remove(seq)
        if self.config.cleanup_mode == "incremental":
            self.allocator.free(seq.pages)
            seq.pages = []
        else:
            self.retained.append(seq)

    def release_finished(self) -> None:
        """Free the pages that finished sequences still hold (cleanup_mode `end` or `none`)."""
        for seq in self.retained:
            self.allocator.free(seq.pages)
            seq.pages = []
        self.retained = []

    def reset(self, keep_cache: bool = False) -> None:
        """Forget every sequence and allocation (after every sequence finished, or when dropping them all);
        `keep_cache` (only when no sequence is left) keeps the prefix cache's pages for later requests."""
        if keep_cache and self.has_work:
            raise RuntimeError("the prefix cache is kept only when no sequence is left")
        self.release_finished()
        self.waiting.clear()
        self.running.clear()
        self._last_queued = None
        self._ahead = None
        self._staged = []
        if not keep_cache:
            self.allocator.reset()
        self.swapper.reset(keep_cache)

    # -- one step ----------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Decide the next device call; an empty output means nothing can run (see `stuck_message`)."""
        if self._ahead is not None and all(q.finished for q in self._ahead):
            self._ahead = None  # every row of the call dispatched ahead has finished: nothing in it is wanted
        if self._ahead is not None:
            seqs = self._ahead
            decode = DecodeCall(seqs, resume=True, chain_pages=self._chain(seqs))
            return SchedulerOutput(decode=decode, **self.swapper.take_ops())
        self._cache_query_tokens = self._cache_hit_tokens = 0
        chunks = self._schedule_chunks()
        limits = self._reserve_multi_step(chunks)
        if limits is not None:  # a sequence admitted with all but its last prompt token cached decodes at once
            seqs = [c.seq for c in chunks]
            budgets = [q.tokens_left(self.max_seq_len) for q in seqs]
            decode = DecodeCall(seqs, False, limits, budgets, self._chain(seqs))
            return SchedulerOutput(chunks, decode=decode, **self._take_counters())
        rows, row_chunk, copies = self._fork(chunks)
        return SchedulerOutput(chunks, rows, row_chunk, copies, **self._take_counters())

    def _take_counters(self) -> dict:
        """The step's counters and its page copies (taken once every allocation of the step is decided: one
        may reclaim cached pages, whose spill to the host tier runs before the step reuses them)."""
        counters = dict(cache_query_tokens=self._cache_query_tokens, cache_hit_tokens=self._cache_hit_tokens,
                        recompute_tokens=self._recompute_tokens, **self.swapper.take_ops())
        self._recompute_tokens = 0
        return counters

    def _schedule_chunks(self) -> list[ScheduledChunk]:
        budget = self.config.max_prefill_size
        chunks: list[ScheduledChunk] = []
        scheduled: set[int] = set()
        for seq in self._staged:  # staged in an earlier step: their page-ins have landed
            self._recache(seq, seq.staged_hits)
            seq.staged_hits = []
        # 1. Running sequences, oldest first: decode tokens and unfinished prompt chunks.
        num_prefill = 0
        for seq in list(self.running):
            if seq not in self.running or budget == 0:
                continue
            if seq.num_pending > 1 and num_prefill >= self.config.max_seqs_in_prefill:
                continue
            n = min(seq.num_pending, budget)
            while not self._grow(seq, n):
                victim = self.running[-1]
                if id(victim) in scheduled:  # never preempt what this step already runs
                    victim = None
                if victim is None or victim is seq:
                    self._preempt(seq)
                    break
                self._preempt(victim)
            if seq in self.running:
                chunks.append(ScheduledChunk.of(seq, n))
                self._cache_pages(seq, n)
                scheduled.add(id(seq))
                budget -= n
                num_prefill += seq.num_pending > 1
        # 2. Admit waiting sequences while slots, budget and pages allow (FIFO: stop at the first that does not fit).
        # One needing page-ins while others run is staged instead (it keeps its slot): waiting[:i] hold those.
        i, staged_slots = 0, 0
        while (i < len(self.waiting) and budget > 0 and num_prefill < self.config.max_seqs_in_prefill
               and self.slots_in_use + staged_slots + 1 + len(self.waiting[i].siblings) <= self.config.max_seqs):
            seq = self.waiting[i]
            swapped, ahead = seq.swapped is not None, bool(chunks)  # ahead: compute for the copies to overlap
            n = min(seq.num_pending, budget)
            if seq.staged:  # staged in an earlier step: its pages are there
                if not self._grow(seq, n):
                    break
                hit = seq.num_computed
                self._staged.remove(seq)
                if swapped:
                    self.swapper.admit(seq)
                seq.staged = False
            elif swapped:  # its pages come back (from the host or the prefix cache): nothing is recomputed
                stage = ahead and self._room_to_stage(seq, len(seq.swapped.host))
                if not self.swapper.swap_in(seq, 0 if stage else n, stage):
                    break
            else:
                hit, hits = self._map_cached(seq)
                n = min(seq.num_pending, budget)
                stage = ahead and bool(hits) and self._room_to_stage(seq, len(hits))
                if not self._grow(seq, 0 if stage else n):
                    self._unmap(seq, hits)
                    break
                self._page_in(seq, hits, stage)
            if seq.staged:
                self._staged.append(seq)
                staged_slots += 1 + len(seq.siblings)
                i += 1
                continue
            del self.waiting[i]
            self.running.append(seq)
            chunks.append(ScheduledChunk.of(seq, n))
            self._cache_pages(seq, n)
            if self.config.prefix_caching and not swapped:
                self._cache_query_tokens += seq.num_prompt_tokens
                self._cache_hit_tokens += hit
            budget -= n
            num_prefill += 1 if not swapped else seq.num_pending > 1
        return chunks

    # -- the prefix cache --------------------------------------------------------------------------

    def _page_key(self, seq: Sequence, i: int) -> PageKey:
        return page_key(seq.pages, seq.token_ids, i, self.config.page_size)

    def _map_cached(self, seq: Sequence) -> tuple[int, list[int]]:
        """Map the cached pages of a sequence's leading full prompt pages (it computes nothing yet), then find
        the pages after them in the host tier (pinned; `_page_in` maps them once the sequence has its pages);
        the tokens both hold, and the host tier's uids. The last token is always computed: its logits pick the
        next token."""
        if not self.config.prefix_caching or seq.pages:
            return 0, []
        ps = self.config.page_size
        end = min(seq.num_prompt_tokens, len(seq.token_ids) - 1) // ps
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

    def _page_in(self, seq: Sequence, hits: list[int], ahead: bool = False) -> None:
        """Page the host tier's pages `_map_cached` found into the sequence's pages after its device hits (its
        computed tokens count them already), and cache them there again under their uids; `ahead`: stage the
        sequence, caching them when they have landed (the next step's `_recache`)."""
        start = seq.num_cached_pages
        self.swapper.page_in_hits(hits, seq.pages[start:start + len(hits)], ahead)
        if ahead:
            seq.staged, seq.staged_hits = True, hits
        else:
            self._recache(seq, hits)

    def _recache(self, seq: Sequence, hits: list[int]) -> None:
        """Cache the host tier's pages paged in to the sequence's pages after its cached ones under their uids."""
        for i, uid in enumerate(hits, seq.num_cached_pages):
            if seq.caching and self.allocator.cache(seq.pages[i], self._page_key(seq, i), uid):
                seq.num_cached_pages += 1
            else:  # not cached again (a forked sample that could not fork): the entries after it are unreachable
                seq.caching = False
                self.swapper.host.free(self.swapper.cache.drop_descendants(uid))

    def _unmap(self, seq: Sequence, hits: list[int]) -> None:
        """Undo `_map_cached` for a sequence that cannot be admitted now."""
        self.swapper.release_hits(hits)
        self.allocator.free(seq.pages)
        seq.pages = []
        seq.num_computed = seq.num_cached_pages = 0

    def _cache_pages(self, seq: Sequence, num_tokens: int) -> None:
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

    def _pages_short(self, seq: Sequence, num_tokens: int) -> int:
        """Pages the sequence lacks to hold `num_tokens` tokens past its computed ones."""
        return max(0, pages_for(seq.num_computed + num_tokens, self.config.page_size) - len(seq.pages))

    def _room_to_stage(self, seq: Sequence, num_pages: int) -> bool:
        """Whether staging `seq`, which maps `num_pages` more pages now, leaves free pages for every staged
        sequence (it too) to grow into all its pending tokens at its admission. A staged sequence never gives its
        pages back (its page-ins would be paid twice), so this keeps the first one admissible whatever runs."""
        ps = self.config.page_size

        def growth(q: Sequence, held: int) -> int:
            return max(0, pages_for(q.num_computed + q.num_pending, ps) - held)

        later = sum(growth(q, len(q.pages)) for q in self._staged) + growth(seq, len(seq.pages) + num_pages)
        return num_pages + later <= self.allocator.num_free

    def _grow(self, seq: Sequence, num_tokens: int) -> bool:
        pages = self.allocator.allocate(self._pages_short(seq, num_tokens))
        if pages is None:
            return False
        seq.pages.extend(pages)
        return True

    def _preempt(self, seq: Sequence) -> None:
        """Swap the sequence's pages out (engine.preemption), or free them: it will recompute its tokens
        (prompt and generated) later."""
        self.running.remove(seq)
        if not self.swapper.swap_out(seq):
            self._recompute_tokens += seq.num_computed
            self.allocator.free(seq.pages)
            seq.pages = []
            seq.num_computed = seq.num_cached_pages = 0
            seq.caching = True
        seq.num_preemptions += 1
        self.num_preemptions += 1
        # Back to the head of the queue, in arrival order among the preempted, after the staged sequences: the
        # first staged one must stay admissible when nothing runs (`_room_to_stage`).
        i = 0
        while i < len(self.waiting) and (self.waiting[i].staged or self.waiting[i].arrival < seq.arrival):
            i += 1
        self.waiting.insert(i, seq)

    def _reserve_multi_step(self, chunks: list[ScheduledChunk]) -> list[int] | None:
        """Decode steps each sequence may take in one device call, its pages for them allocated; None when
        this step must be a single one (not decode-only, a waiting sequence could be admitted now, or the
        pages are not free: the single step's scheduling preempts where it must)."""
        K = self.config.decode_steps
        if K == 1 or self.head_has_slots or not chunks:
            return None
        if not all(c.num_tokens == 1 and c.completes and not c.seq.siblings for c in chunks):
            return None
        limits = [min(K, c.seq.tokens_left(self.max_seq_len)) for c in chunks]
        needs = [self._pages_short(c.seq, limit) for c, limit in zip(chunks, limits)]
        if sum(needs) > self.allocator.num_free:
            self.num_multi_step_fallbacks += 1
            return None
        for c, need in zip(chunks, needs):
            c.seq.pages.extend(self.allocator.allocate(need))
        return limits

    def _chain(self, seqs: list[Sequence]) -> list[list[int]] | None:
        """Pages for the call continuing `seqs`' multi-step call, dispatched before the host reads that one,
        or None when pipelining does not apply: a sequence waits (a row that stops idles through the new
        call, and a waiting sequence would wait for its slot that much longer: measured, a job with early
        stops lost 3 points of occupancy), no row is still running, or the pages for both calls are not
        free. A row the host finished gets no pages (it takes no steps)."""
        self._ahead = None
        if not self.config.pipeline_decode or self.waiting:
            return None
        K = self.config.decode_steps
        # A row that reaches its last token in the call being read is known to end there: when every row
        # does, there is nothing to continue.
        if not any(not q.finished and q.tokens_left(self.max_seq_len) > K for q in seqs):
            return None
        # The host has read every call before the current one: each row's KV covers num_computed tokens, and
        # the current call and the next together write at most min(2K, tokens left) more.
        needs = [0 if q.finished else self._pages_short(q, min(2 * K, q.tokens_left(self.max_seq_len)))
                 for q in seqs]
        if sum(needs) > self.allocator.num_free:
            return None
        for q, need in zip(seqs, needs):
            if need:
                q.pages.extend(self.allocator.allocate(need))
        self.num_pipelined_calls += 1
        self._ahead = seqs
        return [[] if q.finished else q.pages for q in seqs]

    def _fork(self, chunks: list[ScheduledChunk]) -> tuple[list[Sequence], list[int], tuple[list[int], list[int]]]:
        """Output rows of a single step, and the page copies that fork siblings off their parents.

        One row per chunk, plus one per sibling of a sequence whose prompt completes now (the siblings sample
        their first token from the same logits, each with its own key). A sibling shares its parent's full
        prompt pages and gets a copy (made after the step) of the partial last one; with no page free for
        that copy it goes back to the queue and computes its prompt alone (its row is drawn and dropped)."""
        rows, row_chunk, forks = [], [], []
        for i, c in enumerate(chunks):
            rows.append(c.seq)
            row_chunk.append(i)
            if c.completes and c.seq.siblings and len(c.seq.token_ids) == c.seq.num_prompt_tokens:
                forks.append(c.seq)
                rows += c.seq.siblings
                row_chunk += [i] * len(c.seq.siblings)
        src, dst = [], []
        ps = self.config.page_size
        for parent in forks:
            num_full = parent.num_prompt_tokens // ps
            partial = parent.num_prompt_tokens % ps != 0
            for sib in parent.siblings:
                own = self.allocator.allocate(1) if partial else []
                if own is None:
                    self.waiting.append(sib)
                    continue
                self.allocator.share(parent.pages[:num_full])
                sib.pages = parent.pages[:num_full] + own
                if partial:
                    src.append(parent.pages[num_full])
                    dst.append(own[0])
                sib.num_computed = parent.num_prompt_tokens  # the parent's prompt, computed in this step
                sib.num_cached_pages, sib.caching = parent.num_cached_pages, False  # the parent caches them
                self.running.append(sib)  # its slot was counted at the parent's admission
            parent.siblings = []
        return rows, row_chunk, (src, dst)

    # -- checks and messages -----------------------------------------------------------------------

    def check_invariants(self) -> None:
        self.allocator.check([s.pages for s in self.running + self.retained + self._staged])
        assert all(s.staged for s in self._staged) and sum(s.staged for s in self.waiting) == len(self._staged)
        swapper, alloc = self.swapper, self.allocator
        swapper.host.check([s.swapped.host for s in self.waiting if s.swapped is not None]
                           + [swapper.cache.host_pages(), swapper.releasing])
        swapper.cache.check()
        on_device = {alloc.uid(p) for p in range(alloc.num_pages)} - {-1}
        assert not any(uid in swapper.cache for uid in on_device), "a cached page is in both tiers"
        assert self.slots_in_use <= self.config.max_seqs, "more live sequences than engine.max_seqs"
        for s in self.running:
            assert 0 <= s.num_computed <= len(s.token_ids) <= self.max_seq_len, f"sequence {s.request.prompt_id}"
            assert len(s.pages) * self.config.page_size >= s.num_computed
            assert all(self.allocator.refcount(p) >= 1 for p in s.pages)

    def stuck_message(self) -> str:
        head = self.waiting[0] if self.waiting else None
        need = 0 if head is None else pages_for(len(head.token_ids), self.config.page_size)
        return (f"no sequence can run: {len(self.waiting)} waiting, the first needs {need} pages, "
                f"{self.allocator.num_free} of {self.allocator.num_pages} are free and {len(self.retained)} finished "
                f"sequences still hold pages (engine.cleanup_mode={self.config.cleanup_mode}); raise "
                f"engine.max_pages or use cleanup_mode=incremental")
