"""The scheduler: the one owner of pages and sequences. No JAX here.

It owns the `PageAllocator` (only it and its parts below call it), the sequences (waiting, running, finished but
holding pages) and the samples of one prompt that will fork from it, and decides each step in one
`SchedulerOutput`: a ragged step (prompt chunks and decode tokens, FIFO, within the token budget
`max_prefill_size`) or a multi-step decode call. There is no prefill phase: each sequence's computed-token
count catches up with its token count, which gives chunked prefill and mixed steps. Decoding sequences go
first, then prompt chunks; a slot freed by a finished sequence goes to the next waiting one in the same
step. Running out of pages is an answer, not a crash: the newest running sequence is preempted: its pages are
freed and its tokens recomputed later, or (engine.preemption, engine/swap.py) its pages go to the host pool and
come back when it is admitted again.

This file keeps the queues, the admission loop and preemption. Its parts, each acting on the allocator it is
given: the prefix cache at admission (engine/prefix_cache.py), page-ins staged a step ahead
(engine/staging.py), swap preemption and the prefix cache's host tier (engine/swap.py), the multi-step and
pipelined decode calls (engine/decode_planner.py) and the forks of a prompt's samples (engine/fork.py).
"""

from __future__ import annotations

from collections import deque

from engine.capacity import pages_for
from engine.config import EngineConfig
from engine.decode_planner import DecodePlanner
from engine.fork import fork
from engine.page_allocator import PageAllocator
from engine.prefix_cache import PrefixCache
from engine.scheduler_output import ScheduledChunk, SchedulerOutput
from engine.sequence import Sequence
from engine.staging import Staging
from engine.swap import Swapper


class Scheduler:
    def __init__(self, config: EngineConfig, max_seq_len: int) -> None:
        self.config = config
        self.max_seq_len = max_seq_len
        self.allocator = PageAllocator(config.max_pages)
        self.swapper = Swapper(config, self.allocator)  # swap preemption; owns the host pool's pages
        self.prefix = PrefixCache(config, self.allocator, self.swapper)
        self.staging = Staging(config.page_size, self.allocator)
        self.decoding = DecodePlanner(config, self.allocator, max_seq_len)  # multi-step calls and their pages
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in arrival order
        self.retained: list[Sequence] = []  # finished, pages kept (cleanup_mode end / none)
        self._last_queued: Sequence | None = None  # the newest queued sequence, to group samples of one prompt
        self.num_preemptions = 0
        self._cache_query_tokens = 0  # prompt tokens of sequences admitted with a cache lookup, this step
        self._cache_hit_tokens = 0  # of those, tokens whose KV the cache held
        self._recompute_tokens = 0  # computed tokens dropped by preemptions that did not swap, this step

    # -- sequences ---------------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Queue a sequence; another sample of the newest queued prompt waits to fork from it instead."""
        head = self._last_queued
        # The newest queued sequence is still waiting (never admitted, nothing generated): cheap to check (the
        # running list holds at most max_seqs), so queueing a large batch stays linear in its size.
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
        return self.decoding.ahead

    @property
    def num_multi_step_fallbacks(self) -> int:
        return self.decoding.num_multi_step_fallbacks

    @property
    def num_pipelined_calls(self) -> int:
        return self.decoding.num_pipelined_calls

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
        self.decoding.reset()
        self.staging.reset()
        if not keep_cache:
            self.allocator.reset()
        self.swapper.reset(keep_cache)

    # -- one step ----------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Decide the next device call; an empty output means nothing can run (see `stuck_message`)."""
        decode = self.decoding.resume(bool(self.waiting))
        if decode is not None:
            return SchedulerOutput(decode=decode, **self.swapper.take_ops())
        self._cache_query_tokens = self._cache_hit_tokens = 0
        chunks = self._schedule_chunks()
        # A sequence admitted with all but its last prompt token cached decodes at once.
        decode = self.decoding.multi_step(chunks, self.head_has_slots, bool(self.waiting))
        if decode is not None:
            return SchedulerOutput(chunks, decode=decode, **self._take_counters())
        forks = fork(chunks, self.allocator, self.config.page_size)
        self.waiting.extend(forks.requeued)
        self.running.extend(forks.running)
        return SchedulerOutput(chunks, forks.rows, forks.row_chunk, forks.copies, **self._take_counters())

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
        for seq in self.staging.seqs:  # staged in an earlier step: their page-ins have landed
            self.prefix.recache(seq, seq.staged_hits)
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
                self.prefix.cache_pages(seq, n)
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
                self.staging.remove(seq)
                if swapped:
                    self.swapper.admit(seq)
                seq.staged = False
            elif swapped:  # its pages come back (from the host or the prefix cache): nothing is recomputed
                stage = ahead and self.staging.has_room(seq, len(seq.swapped.host))
                if not self.swapper.swap_in(seq, 0 if stage else n, stage):
                    break
            else:
                hit, hits = self.prefix.map_cached(seq)
                n = min(seq.num_pending, budget)
                stage = ahead and bool(hits) and self.staging.has_room(seq, len(hits))
                if not self._grow(seq, 0 if stage else n):
                    self.prefix.unmap(seq, hits)
                    break
                self.prefix.page_in(seq, hits, stage)
            if seq.staged:
                self.staging.add(seq)
                staged_slots += 1 + len(seq.siblings)
                i += 1
                continue
            del self.waiting[i]
            self.running.append(seq)
            chunks.append(ScheduledChunk.of(seq, n))
            self.prefix.cache_pages(seq, n)
            if self.config.prefix_caching and not swapped:
                self._cache_query_tokens += seq.num_prompt_tokens
                self._cache_hit_tokens += hit
            budget -= n
            num_prefill += 1 if not swapped else seq.num_pending > 1
        return chunks

    def _grow(self, seq: Sequence, num_tokens: int) -> bool:
        pages = self.allocator.allocate(seq.pages_short(num_tokens, self.config.page_size))
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
        # first staged one must stay admissible when nothing runs (`Staging.has_room`).
        i = 0
        while i < len(self.waiting) and (self.waiting[i].staged or self.waiting[i].arrival < seq.arrival):
            i += 1
        self.waiting.insert(i, seq)

    # -- checks and messages -----------------------------------------------------------------------

    def check_invariants(self) -> None:
        self.allocator.check([s.pages for s in self.running + self.retained + self.staging.seqs])
        self.staging.check(self.waiting)
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
