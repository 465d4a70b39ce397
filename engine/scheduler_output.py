"""What the scheduler decides for one device call, and what the runner returns: the one contract between
host policy and device math. No JAX here."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from engine.sequence import Sequence


@dataclass(frozen=True)
class ScheduledChunk:
    """New tokens of one sequence in a ragged step: `token_ids[start:start + num_tokens]`."""

    seq: Sequence
    start: int  # the sequence's computed tokens when scheduled
    num_tokens: int
    completes: bool  # the chunk reaches the sequence's last token, so its logits pick the next token

    @classmethod
    def of(cls, seq: Sequence, num_tokens: int) -> "ScheduledChunk":
        return cls(seq, seq.num_computed, num_tokens, seq.num_computed + num_tokens == len(seq.token_ids))


@dataclass(frozen=True)
class DecodeCall:
    """Several decode steps of the running sequences in one device call (every row decoding, none waiting).

    A fresh call feeds each row's last token and lets row r take up to `limits[r]` steps (pages reserved for
    them) and generate `budgets[r]` tokens in it and any call chained to it; the device stops a row at an EOS
    id or its limit. `resume` reads the call dispatched ahead for these rows in the previous step instead.
    `chain_pages` (pipelined decoding), when set, asks for the call continuing these rows to be dispatched
    before this one is read; row r's pages cover both calls, and an empty list means the host finished row r
    (a stop string) and it takes no steps.
    """

    seqs: list[Sequence]
    resume: bool = False
    limits: list[int] = field(default_factory=list)
    budgets: list[int] = field(default_factory=list)
    chain_pages: list[list[int]] | None = None


@dataclass(frozen=True)
class SchedulerOutput:
    """One device call: a ragged step of `chunks` (sampling one token per output row), or a `decode` call.

    In a ragged step, output row r samples from the last token of chunk `row_chunk[r]` for sequence `rows[r]`
    (siblings of a prompt read its chunk); `copies` (src, dst) are pages to copy after the step, the forked
    siblings' partial last prompt pages. Before either kind of call, `swap_out` pages go to the host pool, then
    `swap_in` pages come back (engine.preemption swap); a swap-out reads the pages before the step reuses them.
    `swap_in_ahead` pages are paged in for a later step (a sequence staged now, engine/swap.py): their copies
    start before this call and land before the next one, which is the first that reads them.
    """

    chunks: list[ScheduledChunk] = field(default_factory=list)
    rows: list[Sequence] = field(default_factory=list)
    row_chunk: list[int] = field(default_factory=list)
    copies: tuple[list[int], list[int]] = ((), ())
    decode: DecodeCall | None = None
    cache_query_tokens: int = 0  # prompt tokens of the sequences admitted in this step with a prefix cache lookup
    cache_hit_tokens: int = 0  # of those, tokens whose KV came from cached pages (not computed)
    swap_out: tuple[list[int], list[int]] = ((), ())  # (device pages, host pages) to copy out before the step
    swap_in: tuple[list[int], list[int]] = ((), ())  # (host pages, device pages) to copy in after the swap-outs
    swap_in_ahead: tuple[list[int], list[int]] = ((), ())  # (host pages, device pages) to copy in for the next call
    swap_avoided_tokens: int = 0  # computed tokens of the sequences swapped in now, not recomputed
    recompute_tokens: int = 0  # computed tokens of the sequences preempted now without a swap (recomputed later)

    @property
    def is_empty(self) -> bool:
        return not self.chunks and self.decode is None


@dataclass(frozen=True)
class RunnerOutput:
    """What a device call returns. A ragged step: tokens i32[rows], logprobs f32[rows]. A decode call:
    tokens i32[K, rows], logprobs f32[K, rows] and steps i32[rows], the steps each row took (decided on the
    device: its limit or an EOS id); row r's tokens are tokens[:steps[r], r]."""

    tokens: np.ndarray
    logprobs: np.ndarray
    steps: np.ndarray | None = None
