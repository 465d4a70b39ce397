"""The multi-step decode calls (`engine.decode_steps`, `engine.pipeline_decode`): when a step is one, how many
steps each row may take, and their pages. Part of the scheduler. No JAX here.

A step whose every scheduled chunk is one decode token (nothing else waiting to be admitted) may become one
device call of up to `decode_steps` steps (`multi_step`), its rows' pages reserved for all of them. With
pipelined decoding the call continuing it is dispatched before the host reads it (`chain`, its pages reserved
too), and the next step reads that call (`resume`). The device side is engine/device/multi_step.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.kv.kv_cache_manager import KVCacheManager
from engine.scheduling.sequence import Chunk, Sequence


@dataclass(frozen=True)
class PlannedDecode:
    """A multi-step call as planned, over the live sequences (the scheduler turns it into a plain PlannedDecode,
    engine/scheduling/scheduler_output.py, which says what each field means)."""

    seqs: list[Sequence]
    resume: bool = False
    limits: list[int] = field(default_factory=list)
    budgets: list[int] = field(default_factory=list)
    chain_pages: list[list[list[int]]] | None = None


class DecodePlanner:
    def __init__(self, decode_steps: int, pipeline_decode: bool, page_size: int, kv: KVCacheManager,
                 max_seq_len: int) -> None:
        self.decode_steps = decode_steps
        self.pipeline_decode = pipeline_decode
        self.page_size = page_size
        self.kv = kv  # the pages of every call's rows are reserved through it
        self.max_seq_len = max_seq_len
        # The rows of a multi-step call dispatched ahead (engine.pipeline_decode), not yet read by the host.
        self.ahead: list[Sequence] | None = None
        self.num_multi_step_fallbacks = 0  # decode-only steps run singly because their pages were not free
        self.num_pipelined_calls = 0  # multi-step calls dispatched ahead

    def reset(self) -> None:
        self.ahead = None

    def resume(self, waiting: bool) -> PlannedDecode | None:
        """The call reading the one dispatched ahead, or None when there is none or every row of it has finished
        (nothing in it is wanted). `waiting`: a sequence waits to be admitted (see `chain`)."""
        if self.ahead is not None and all(q.finished for q in self.ahead):
            self.ahead = None
        if self.ahead is None:
            return None
        seqs = self.ahead
        return PlannedDecode(seqs, resume=True, chain_pages=self.chain(seqs, waiting))

    def multi_step(self, chunks: list[Chunk], head_has_slots: bool, waiting: bool) -> PlannedDecode | None:
        """The scheduled chunks as one multi-step call, its pages reserved, or None when this step must be a single
        one (see `reserve`). `head_has_slots`: the first waiting sequence could be admitted now."""
        limits = self.reserve(chunks, head_has_slots)
        if limits is None:
            return None
        seqs = [c.seq for c in chunks]
        budgets = [q.tokens_left(self.max_seq_len) for q in seqs]
        return PlannedDecode(seqs, False, limits, budgets, self.chain(seqs, waiting))

    def reserve(self, chunks: list[Chunk], head_has_slots: bool) -> list[int] | None:
        """Decode steps each sequence may take in one device call, its pages for them allocated; None when
        this step must be a single one (not decode-only, a row has a structured output, a waiting sequence could be admitted now, or the
        pages are not free: the single step's scheduling preempts where it must)."""
        K = self.decode_steps
        if K == 1 or head_has_slots or not chunks:
            return None
        if not all(c.num_tokens == 1 and c.completes and not c.seq.siblings for c in chunks):
            return None
        if any(c.seq.constraint is not None for c in chunks):  # each token's mask needs the token before it
            return None
        limits = [min(K, c.seq.tokens_left(self.max_seq_len)) for c in chunks]
        needs = [c.seq.pages_short(limit, self.page_size) for c, limit in zip(chunks, limits)]
        if not self.kv.reserve([c.seq for c in chunks], needs):
            self.num_multi_step_fallbacks += 1
            return None
        return limits

    def chain(self, seqs: list[Sequence], waiting: bool) -> list[list[int]] | None:
        """Pages for the call continuing `seqs`' multi-step call, dispatched before the host reads that one,
        or None when pipelining does not apply: a sequence waits (a row that stops idles through the new
        call, and a waiting sequence would wait for its slot that much longer: measured, a job with early
        stops lost 3 points of occupancy), no row is still running, or the pages for both calls are not
        free. A row the host finished gets no pages (it takes no steps)."""
        self.ahead = None
        if not self.pipeline_decode or waiting:
            return None
        K = self.decode_steps
        # A row that reaches its last token in the call being read is known to end there: when every row
        # does, there is nothing to continue.
        if not any(not q.finished and q.tokens_left(self.max_seq_len) > K for q in seqs):
            return None
        # The host has read every call before the current one: each row's KV covers num_computed tokens, and
        # the current call and the next together write at most min(2K, tokens left) more.
        ps = self.page_size
        needs = [0 if q.finished else q.pages_short(min(2 * K, q.tokens_left(self.max_seq_len)), ps) for q in seqs]
        if not self.kv.reserve(seqs, needs):
            return None
        self.num_pipelined_calls += 1
        self.ahead = seqs
        return [[] if q.finished else q.pages for q in seqs]
