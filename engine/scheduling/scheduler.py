"""The scheduler: the one owner of the sequences. No JAX here.

It owns the sequences (waiting, running, finished but holding pages) and the samples of one prompt that will fork from it, and decides each step in one
`SchedulerOutput`: a ragged step (prompt chunks and decode tokens, FIFO, within the token budget
`max_prefill_size`) or a multi-step decode call. There is no prefill phase: each sequence's computed-token
count catches up with its token count, which gives chunked prefill and mixed steps. Decoding sequences go
first, then prompt chunks; a slot freed by a finished sequence goes to the next waiting one in the same
step. Running out of pages is an answer, not a crash: the newest running sequence is preempted: its pages are
freed and its tokens recomputed later, or (engine.preemption, engine/kv/swap.py) its pages go to the host pool and
come back when it is admitted again.

This file keeps the queues, the admission loop, preemption and `postprocess`, the one writer of a sequence's
progress after a device call (its computed tokens, its new tokens, its end). Pages are the KV cache manager's
(engine/kv/kv_cache_manager.py: the page allocator, the prefix cache, the host tier, swap and staging): the scheduler
asks it for pages and gets yes or no. Its other parts: the multi-step and pipelined decode calls
(engine/scheduling/decode_planner.py) and the forks of a prompt's samples (engine/scheduling/fork.py).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from engine.sizing.capacity import pages_for
from engine.scheduling.decode_planner import DecodePlanner, PlannedDecode
from engine.scheduling.fork import fork
from engine.kv.kv_cache_config import KVCacheConfig
from engine.kv.kv_cache_manager import KVCacheManager, KVCopies
from engine.sampling.row_sampling import row_sampling
from engine.scheduling.scheduler_output import DecodeCall, RunnerOutput, ScheduledChunk, SchedulerOutput, StepCounts
from engine.scheduling.sequence import Chunk, Sequence, take_scores


@dataclass(frozen=True)
class SchedulerConfig:
    """The part of EngineConfig the scheduler reads (EngineConfig documents each key)."""

    max_seqs: int
    max_seqs_in_prefill: int
    max_prefill_size: int  # tokens a ragged step may carry
    cleanup_mode: str  # none | end | incremental
    decode_steps: int
    pipeline_decode: bool
    debug_invariants: bool  # check the invariants after every postprocess
    kv: KVCacheConfig

    @property
    def page_size(self) -> int:
        return self.kv.page_size

    @classmethod
    def of(cls, config, groups=None) -> "SchedulerConfig":
        """The sub-config of an EngineConfig, with the model's layer groups (engine/kv/kv_groups.py; None: one page
        table for every layer)."""
        return cls(config.max_seqs, config.max_seqs_in_prefill, config.max_prefill_size, config.cleanup_mode,
                   config.decode_steps, config.pipeline_decode, config.debug_invariants,
                   KVCacheConfig.of(config, groups))


@dataclass
class _Scheduled:
    """What the scheduler handed out last, over its live sequences: `postprocess` applies the result to them."""

    output: SchedulerOutput
    chunks: list[Chunk]
    rows: list[Sequence]  # a ragged step's output rows, or a multi-step call's rows


class Scheduler:
    def __init__(self, config: SchedulerConfig, max_seq_len: int) -> None:
        self.config = config
        self.max_seq_len = max_seq_len
        self.kv = KVCacheManager(config.kv)  # every page, in both tiers
        # Multi-step calls and their pages.
        self.decoding = DecodePlanner(config.decode_steps, config.pipeline_decode, config.page_size, self.kv,
                                      max_seq_len)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in arrival order
        self.retained: list[Sequence] = []  # finished, pages kept (cleanup_mode end / none)
        self._last_queued: Sequence | None = None  # the newest queued sequence, to group samples of one prompt
        self.num_preemptions = 0
        self._cache_query_tokens = 0  # prompt tokens of sequences admitted with a cache lookup, this step
        self._cache_hit_tokens = 0  # of those, tokens whose KV the cache held
        self._recompute_tokens = 0  # computed tokens dropped by preemptions that did not swap, this step
        self._scheduled: _Scheduled | None = None

    @property
    def allocator(self):
        """The KV cache manager's page allocator, read-only here (tests and stats read its counts)."""
        return self.kv.allocator

    @property
    def swapper(self):
        """The KV cache manager's host pool, read-only here (tests and stats read its counts)."""
        return self.kv.swapper

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
            self.kv.free(seq)
        else:
            self.retained.append(seq)

    def release_finished(self) -> None:
        """Free the pages that finished sequences still hold (cleanup_mode `end` or `none`)."""
        for seq in self.retained:
            self.kv.free(seq)
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
        self._scheduled = None
        self.kv.reset(keep_cache)

    # -- one step ----------------------------------------------------------------------------------

    def schedule(self) -> tuple[SchedulerOutput, StepCounts]:
        """Decide the next device call, and its counts for the stats; an empty output means nothing can run (see
        `stuck_message`)."""
        decode = self.decoding.resume(bool(self.waiting))
        if decode is not None:
            return self._output([], [], [], decode, self.kv.take_copies(), 0, 0)
        self._cache_query_tokens = self._cache_hit_tokens = 0
        chunks = self._schedule_chunks()
        # A sequence admitted with all but its last prompt token cached decodes at once.
        scoring = any(c.seq.score_targets(c.start, c.num_tokens)[1] for c in chunks)  # a ragged step returns scores
        decode = None if scoring else self.decoding.multi_step(chunks, self.head_has_slots, bool(self.waiting))
        if decode is not None:
            return self._output(chunks, [], [], decode, self._take_copies(), self._cache_query_tokens,
                                self._cache_hit_tokens)
        forks = fork(chunks, self.kv)
        self.waiting.extend(forks.requeued)
        self.running.extend(forks.running)
        return self._output(chunks, forks.rows, forks.row_chunk, None, self._take_copies(), self._cache_query_tokens,
                            self._cache_hit_tokens)

    def _take_copies(self) -> KVCopies:
        """The step's page copies (taken once every allocation of the step is decided: one may reclaim cached
        pages, whose spill to the host tier runs before the step reuses them)."""
        copies = self.kv.take_copies()
        self._recompute_tokens, self._step_recompute_tokens = 0, self._recompute_tokens
        return copies

    def _output(self, chunks: list[Chunk], rows: list[Sequence], row_chunk: list[int], planned: PlannedDecode | None,
                copies: KVCopies, query_tokens: int, hit_tokens: int) -> tuple[SchedulerOutput, StepCounts]:
        """The step as plain data for the runner (copies of the live sequences' tokens and pages, taken once
        every page of the step is decided), and its counts."""
        decode = None
        if planned is not None:
            seqs = planned.seqs
            fresh = not planned.resume
            decode = DecodeCall([q.arrival for q in seqs], [not q.finished for q in seqs], planned.resume,
                                [q.token_ids[-1] for q in seqs] if fresh else [],
                                [q.num_computed for q in seqs] if fresh else [],
                                [tuple(map(tuple, q.pages)) for q in seqs],
                                [row_sampling(q) for q in seqs] if fresh else [],
                                planned.limits, planned.budgets,
                                None if planned.chain_pages is None else [[list(g) for g in p] for p in planned.chain_pages])
            rows = seqs
        out = SchedulerOutput(
            [ScheduledChunk(c.seq.arrival, tuple(c.seq.token_ids[c.start:c.start + c.num_tokens]), c.start,
                            tuple(map(tuple, c.seq.pages)), c.completes, *c.seq.score_targets(c.start, c.num_tokens),
                            c.seq.request.sampling.prompt_logprobs or 0, c.seq.num_prompt_tokens)
             for c in chunks] if decode is None else [],
            [q.arrival for q in rows] if decode is None else [], [row_sampling(q) for q in rows] if decode is None else [],
            row_chunk, copies.copies, decode, copies.swap_out, copies.swap_in, copies.swap_in_ahead)
        recompute = self._step_recompute_tokens if planned is None or not planned.resume else 0
        counts = StepCounts(query_tokens, hit_tokens, copies.swap_avoided_tokens, recompute, len(copies.swap_out[0]),
                            len(copies.swap_in[0]) + len(copies.swap_in_ahead[0]), len(copies.swap_in_ahead[0]),
                            self.kv.swapper.host.num_used)
        self._scheduled = _Scheduled(out, chunks, rows)
        return out, counts

    def postprocess(self, output: SchedulerOutput, result: RunnerOutput) -> list[Sequence]:
        """Apply a device call's result to the sequences `output` (the last `schedule`'s) named: the one writer of
        their progress. Chunks' tokens are now computed; each row draws its sequence's next tokens up to the one
        that ends it; a sequence that ends is finished (`finish`). Returns the sequences finished, in order."""
        scheduled = self._scheduled
        if scheduled is None or scheduled.output is not output:
            raise RuntimeError("postprocess takes the output of the last schedule(), once")
        self._scheduled = None
        done = self._take_tokens(scheduled, result) if output.decode is None else self._take_steps(scheduled, result)
        for seq in done:
            self.finish(seq)
        for seq in self.running:  # sliding layer groups: the pages the computed tokens left behind go back now
            self.kv.release(seq)
        if self.config.debug_invariants:
            self.check_invariants()
        return done

    @staticmethod
    def _take_tokens(scheduled: _Scheduled, result: RunnerOutput) -> list[Sequence]:
        """A ragged step: each chunk's tokens are now cached; each output row whose chunk completes its
        sequence draws that sequence's next token (a sibling that could not fork will run alone: skipped)."""
        for c in scheduled.chunks:
            c.seq.num_computed += c.num_tokens
        out = scheduled.output
        if result.scores is not None:
            take_scores([c.seq for c in scheduled.chunks], out.chunks, result.scores)
        done = []
        for seq, i, token, logprob in zip(scheduled.rows, out.row_chunk, result.tokens.tolist(),
                                          result.logprobs.tolist()):
            if out.chunks[i].completes and seq.num_computed == len(seq.token_ids):
                if seq.append(token, logprob) is not None:
                    done.append(seq)
        return done

    @staticmethod
    def _take_steps(scheduled: _Scheduled, result: RunnerOutput) -> list[Sequence]:
        """A multi-step call: row r's first steps[r] tokens (the device's count, trusted), up to the one a
        stop string ends on; a row the host finished before (its call ran ahead) is skipped. A row the device
        stopped at a stop id that the host does not finish is an engine fault: an error, not a row that never ends."""
        tokens, logprobs = result.tokens.T.tolist(), result.logprobs.T.tolist()
        done = []
        for seq, row_tokens, row_logprobs, num_steps, stopped in zip(scheduled.rows, tokens, logprobs,
                                                                     result.steps.tolist(), result.stopped.tolist()):
            if seq.finished:
                continue
            for token, logprob in zip(row_tokens[:num_steps], row_logprobs[:num_steps]):
                seq.num_computed += 1  # the KV of the token this one was generated from is cached
                if seq.append(token, logprob) is not None:  # later tokens of this row are dropped
                    done.append(seq)
                    break
            if stopped and not seq.finished:
                raise RuntimeError(f"engine fault: the device stopped prompt {seq.request.prompt_id!r}'s sample "
                                   f"{seq.request.generation_index} at token "
                                   f"{row_tokens[num_steps - 1]}, which the host does not stop at (their stop ids "
                                   "differ); please report it")
        return done

    def _schedule_chunks(self) -> list[Chunk]:
        budget = self.config.max_prefill_size
        chunks: list[Chunk] = []
        scheduled: set[int] = set()
        self.kv.land_staged()  # staged in an earlier step: their page-ins have landed
        # 1. Running sequences, oldest first: decode tokens and unfinished prompt chunks.
        num_prefill = 0
        for seq in list(self.running):
            if seq not in self.running or budget == 0:
                continue
            if seq.num_pending > 1 and num_prefill >= self.config.max_seqs_in_prefill:
                continue
            n = min(seq.num_pending, budget)
            while not self.kv.allocate(seq, n):
                victim = self.running[-1]
                if id(victim) in scheduled:  # never preempt what this step already runs
                    victim = None
                if victim is None or victim is seq:
                    self._preempt(seq)
                    if not self.running and not any(q.staged for q in self.waiting):
                        # It ran alone and still lacks pages: only finished sequences' pages (retained until
                        # the call ends, engine.cleanup_mode) stand in its way, and its need only grows, so
                        # readmitting it would recompute and preempt it again forever.
                        raise RuntimeError(self.stuck_message())
                    break
                self._preempt(victim)
            if seq in self.running:
                chunks.append(Chunk.of(seq, n))
                self.kv.cache_pages(seq, n)
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
                if not self.kv.allocate(seq, n):
                    break
                hit = seq.num_computed
                self.kv.admit_staged(seq)
            elif swapped:  # its pages come back (from the host or the prefix cache): nothing is recomputed
                stage = ahead and self.kv.can_stage(seq, len(seq.swapped.host[0]))
                if not self.kv.swap_in(seq, 0 if stage else n, stage):
                    break
            else:
                hit, hits = self.kv.map_cached(seq)
                n = min(seq.num_pending, budget)
                stage = ahead and bool(hits) and self.kv.can_stage(seq, len(hits))
                if not self.kv.allocate(seq, 0 if stage else n):
                    self.kv.unmap(seq, hits)
                    break
                self.kv.page_in(seq, hits, stage)
            if seq.staged:
                self.kv.stage(seq)
                staged_slots += 1 + len(seq.siblings)
                i += 1
                continue
            del self.waiting[i]
            self.running.append(seq)
            chunks.append(Chunk.of(seq, n))
            self.kv.cache_pages(seq, n)
            if self.config.kv.prefix_caching and not swapped:
                self._cache_query_tokens += seq.num_prompt_tokens
                self._cache_hit_tokens += hit
            budget -= n
            num_prefill += 1 if not swapped else seq.num_pending > 1
        return chunks

    def _preempt(self, seq: Sequence) -> None:
        """Swap the sequence's pages out (engine.preemption), or free them: it will recompute its tokens
        (prompt and generated) later."""
        self.running.remove(seq)
        computed = seq.num_computed
        if not self.kv.swap_out(seq):
            self._recompute_tokens += computed
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
        self.kv.check(self.running + self.retained, list(self.waiting))
        assert self.slots_in_use <= self.config.max_seqs, "more live sequences than engine.max_seqs"
        for s in self.running:
            assert 0 <= s.num_computed <= len(s.token_ids) <= self.max_seq_len, f"sequence {s.request.prompt_id}"
            assert s.num_pages * self.config.page_size >= s.num_computed

    def stuck_message(self) -> str:
        head = self.waiting[0] if self.waiting else None
        need = 0 if head is None else pages_for(len(head.token_ids), self.config.page_size)
        return (f"no sequence can run: {len(self.waiting)} waiting, the first needs {need} pages, "
                f"{self.kv.stuck_message()} and {len(self.retained)} finished "
                f"sequences still hold pages (engine.cleanup_mode={self.config.cleanup_mode}); raise "
                f"engine.max_pages or use cleanup_mode=incremental")
