"""What the scheduler decides for one device call, and what the runner returns: the one contract between
host policy and device math. Plain data (ids, token and page lists, copy lists), no live sequence; no JAX here.

A sequence is named by its id (`Sequence.arrival`, unique in an engine); the scheduler maps ids back to its
sequences in `Scheduler.postprocess`. The step's counts for the engine's stats travel beside the output
(`StepCounts`), not in it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from engine.sampling.row_sampling import RowSampling


@dataclass(frozen=True)
class ScheduledChunk:
    """New tokens of one sequence in a ragged step: its tokens `start .. start + num_tokens - 1`."""

    seq_id: int
    token_ids: tuple[int, ...]  # the chunk's new tokens
    start: int  # the sequence's computed tokens when scheduled = position of the first new token
    pages: tuple[tuple[int, ...], ...]  # the sequence's pages in each layer group (Sequence.pages), covering at
    # least start + num_tokens tokens
    completes: bool  # the chunk reaches the sequence's last token, so its logits pick the next token
    score_offset: int = 0  # chunk offset of the first token whose logits score the token after it
    score_targets: tuple[int, ...] = ()  # the tokens scored from offsets score_offset, score_offset + 1, ...
    num_top: int = 0  # the most likely tokens returned at each scored position (sampling.prompt_logprobs)
    num_prompt_tokens: int | None = None  # the sequence's prompt tokens (SeqChunk.num_prompt_tokens)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class DecodeCall:
    """Several decode steps of the running sequences in one device call (every row decoding, none waiting).

    A fresh call feeds row r's last token `token_ids[r]` at position `starts[r]` (its computed tokens) and lets
    it take up to `limits[r]` steps (`pages[r]` reserved for them) and generate `budgets[r]` tokens in it and
    any call chained to it; the device stops a row at an EOS id or its limit. `resume` reads the call
    dispatched ahead for these rows in the previous step instead (only `seq_ids`, `live`, `pages` and
    `chain_pages` are set then). `chain_pages` (pipelined decoding), when set, asks for the call continuing these rows to be
    dispatched before this one is read; row r's pages cover both calls, and an empty list means the host
    finished row r (a stop string) and it takes no steps. `live[r]`: the host had not finished row r when the
    call was scheduled (a row of a call run ahead may have finished since it was dispatched).
    """

    seq_ids: list[int]
    live: list[bool]
    resume: bool = False
    token_ids: list[int] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    pages: list[tuple[tuple[int, ...], ...]] = field(default_factory=list)  # each row's pages (of each group)
    # when scheduled (chained too)
    sampling: list[RowSampling] = field(default_factory=list)
    limits: list[int] = field(default_factory=list)
    budgets: list[int] = field(default_factory=list)
    chain_pages: list[list[list[int]]] | None = None


@dataclass(frozen=True)
class SchedulerOutput:
    """One device call: a ragged step of `chunks` (sampling one token per output row), or a `decode` call.

    In a ragged step, output row r samples from the last token of chunk `row_chunk[r]` for sequence
    `row_ids[r]`, drawn as `row_sampling[r]` says (siblings of a prompt read its chunk); `copies` (src, dst)
    are pages to copy after the step, the forked siblings' partial last prompt pages. Before either kind of
    call, `swap_out` pages go to the host pool, then `swap_in` pages come back (engine.preemption swap); a
    swap-out reads the pages before the step reuses them. `swap_in_ahead` pages are paged in for a later step (a
    sequence staged now, engine/kv/swap.py): their copies start before this call and land before the next one,
    which is the first that reads them.
    """

    chunks: list[ScheduledChunk] = field(default_factory=list)
    row_ids: list[int] = field(default_factory=list)
    row_sampling: list[RowSampling] = field(default_factory=list)
    row_chunk: list[int] = field(default_factory=list)
    copies: tuple[list[int], list[int]] = ((), ())
    decode: DecodeCall | None = None
    swap_out: tuple[list[int], list[int]] = ((), ())  # (device pages, host pages) to copy out before the step
    swap_in: tuple[list[int], list[int]] = ((), ())  # (host pages, device pages) to copy in after the swap-outs
    swap_in_ahead: tuple[list[int], list[int]] = ((), ())  # (host pages, device pages) to copy in for the next call

    @property
    def is_empty(self) -> bool:
        return not self.chunks and self.decode is None


@dataclass(frozen=True)
class StepCounts:
    """A scheduled step's counts for the engine's stats (EngineStats), beside its SchedulerOutput."""

    cache_query_tokens: int = 0  # prompt tokens of the sequences admitted in this step with a prefix cache lookup
    cache_hit_tokens: int = 0  # of those, tokens whose KV came from cached pages (not computed)
    swap_avoided_tokens: int = 0  # computed tokens of the sequences swapped in now, not recomputed
    recompute_tokens: int = 0  # computed tokens of the sequences preempted now without a swap (recomputed later)
    kv_pages_out: int = 0  # pages copied to the host pool with this step
    kv_pages_in: int = 0  # pages copied back (for this step or, staged, the next)
    kv_pages_in_ahead: int = 0  # of those, the ones for the next step
    host_kv_pages_in_use: int = 0  # host pool pages in use once the step is scheduled


@dataclass(frozen=True)
class RunnerOutput:
    """What a device call returns. A ragged step: tokens i32[rows], logprobs f32[rows]. A decode call:
    tokens i32[K, rows], logprobs f32[K, rows] and steps i32[rows], the steps each row took (decided on the
    device: its limit or a stop id); row r's tokens are tokens[:steps[r], r]; stopped bool[rows]: the device stopped
    row r at a stop id."""

    tokens: np.ndarray
    logprobs: np.ndarray
    steps: np.ndarray | None = None
    stopped: np.ndarray | None = None
    scores: "ScoredTokens | None" = None  # a ragged step's scored prompt tokens, chunk by chunk


@dataclass(frozen=True)
class ScoredTokens:
    """The prompt tokens a ragged step scored, the chunks' `score_targets` one after another (Q in all):
    logprobs f32[Q], is_argmax bool[Q], top_ids i32[Q, K] and top_logprobs f32[Q, K] (K: the step's largest
    `num_top`, rounded up; a chunk reads its own first `num_top`)."""

    logprobs: np.ndarray
    is_argmax: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray
