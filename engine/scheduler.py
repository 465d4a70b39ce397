"""Decides, each step, which tokens of which sequences run. Host only: no JAX.

There are no prefill and decode phases: every running sequence catches its computed-token count
up to its token count, within a per-step token budget (`max_prefill_size`). Decoding sequences go
first (one token each), then prompt chunks, FIFO. Admission is continuous: a slot freed by a
finished sequence goes to the next waiting one in the same call. Running out of pages is an answer,
not a crash: the newest running sequence is preempted (its pages freed, recomputed later).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from engine.config import EngineConfig
from engine.page_allocator import PageAllocator
from engine.sequence import Sequence


@dataclass(frozen=True)
class ScheduledChunk:
    seq: Sequence
    num_tokens: int  # new tokens this step, starting at seq.num_computed

    @property
    def completes(self) -> bool:
        """True when this chunk reaches the sequence's last token, so its logits pick the next token."""
        return self.seq.num_computed + self.num_tokens == len(self.seq.token_ids)


class Scheduler:
    def __init__(self, config: EngineConfig, allocator: PageAllocator) -> None:
        self.config = config
        self.allocator = allocator
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in arrival order
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

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

    def _pages_needed(self, seq: Sequence, num_tokens: int) -> int:
        return max(0, math.ceil((seq.num_computed + num_tokens) / self.config.page_size) - len(seq.pages))

    def _grow(self, seq: Sequence, num_tokens: int) -> bool:
        pages = self.allocator.allocate(self._pages_needed(seq, num_tokens))
        if pages is None:
            return False
        seq.pages.extend(pages)
        return True

    def _preempt(self, seq: Sequence) -> None:
        """Free the sequence's pages; it will recompute its tokens (prompt and generated) later."""
        self.running.remove(seq)
        self.allocator.free(seq.pages)
        seq.pages = []
        seq.num_computed = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        # Back to the head of the queue, in arrival order among the preempted.
        i = 0
        while i < len(self.waiting) and self.waiting[i].arrival < seq.arrival:
            i += 1
        self.waiting.insert(i, seq)

    def schedule(self) -> list[ScheduledChunk]:
        budget = self.config.max_prefill_size
        chunks: list[ScheduledChunk] = []
        scheduled: set[int] = set()
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
                chunks.append(ScheduledChunk(seq, n))
                scheduled.add(id(seq))
                budget -= n
                num_prefill += seq.num_pending > 1
        # 2. Admit waiting sequences while slots, budget and pages allow (FIFO: stop at the first that does not fit).
        while self.head_has_slots and budget > 0 and num_prefill < self.config.max_seqs_in_prefill:
            seq = self.waiting[0]
            n = min(seq.num_pending, budget)
            if not self._grow(seq, n):
                break
            self.waiting.popleft()
            self.running.append(seq)
            chunks.append(ScheduledChunk(seq, n))
            budget -= n
            num_prefill += 1
        return chunks

    def admit_fork(self, seq: Sequence) -> None:
        """A sibling forked from a running sequence joins the running set (its slot was counted at admission)."""
        self.running.append(seq)

    def finish(self, seq: Sequence, free_pages: bool) -> None:
        """Take a finished sequence out of the running set; free its pages now or leave them to the caller."""
        self.running.remove(seq)
        if free_pages:
            self.allocator.free(seq.pages)
            seq.pages = []
