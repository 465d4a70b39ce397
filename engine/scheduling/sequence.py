"""One sample being generated: its tokens, how many are in the KV cache, its pages, its stop state."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from engine.sizing.capacity import pages_for
from engine.config import SamplingConfig
from engine.sampling.structured import Constraint
from engine.scheduling.stop import StopChecker, StopDecision


@dataclass(frozen=True)
class Request:
    """One sample to generate: (prompt_id, generation_index) names it and seeds its random stream.

    A scored request (`num_context_tokens` set) generates nothing: `prompt_token_ids` is a context (its first
    `num_context_tokens` ids) followed by a continuation, and its record carries each continuation token's logprob
    under the model and whether it was the argmax (engine/record.py)."""

    prompt_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingConfig
    generation_index: int = 0
    num_context_tokens: int | None = None

    @property
    def is_scored(self) -> bool:
        return self.num_context_tokens is not None

    @property
    def first_scored(self) -> int | None:
        """The first prompt position whose logprob is returned (1 with sampling.prompt_logprobs, else the
        continuation's first), or None when no prompt token is scored."""
        if self.sampling.prompt_logprobs is not None:
            return 1
        return self.num_context_tokens


@dataclass(frozen=True)
class TokenScore:
    """A prompt token under the model: its logprob, whether it was the argmax (ties to the lowest id), and the
    `top` most likely (token id, logprob) pairs at its position (sampling.prompt_logprobs; empty otherwise)."""

    logprob: float
    is_argmax: bool
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class SwappedPages:
    """Where a swapped-out sequence's pages are (engine.preemption swap): its page i of group g in host page
    `host[g][i]` (kv_groups.NONE: a page it had given back)."""

    host: list[list[int]]
    num_cached_pages: int  # the sequence's num_cached_pages when it was swapped out


@dataclass(eq=False)  # a sequence is a mutable state: the scheduler's `in` and `remove` compare identity
class Sequence:
    """Invariants: `num_computed <= len(token_ids)`; `pages` cover at least `num_computed` tokens; the
    generated ids are `token_ids[num_prompt_tokens:]` and are stored nowhere else (the stop checker reads them
    from here)."""

    request: Request
    arrival: int  # admission order (FIFO); preempted sequences keep theirs
    base_key: np.ndarray  # u32[2] from (seed, prompt_id, generation_index)
    stop: StopChecker
    token_ids: list[int] = field(default_factory=list)  # prompt followed by generated tokens
    logprobs: list[float] = field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V are in the cache
    pages: list[list[int]] = field(default_factory=list)
    """Its pages, one list per layer group of the pool (engine/kv/kv_groups.py), all of one length (`num_pages`;
    page i holds tokens i * page_size ..), kv_groups.NONE where a sliding group gave a page back; [] when it holds
    none. The KV cache manager's alone to change."""
    num_preemptions: int = 0
    siblings: list["Sequence"] = field(default_factory=list)
    """Other samples of the same prompt, waiting to fork from this one when its prompt is computed."""
    num_cached_pages: int = 0
    """Leading pages the prefix cache holds for this sequence's prompt (mapped from it or cached by it); pages
    from there on are cached as their tokens are scheduled, until one's key is already held elsewhere."""
    swapped: SwappedPages | None = None
    """Set while the sequence waits swapped out: its pages are in the host pool, `pages` is empty, and
    `num_computed` still counts the tokens whose KV they hold."""
    staged: bool = False
    """Set while the sequence waits with its pages mapped and their page-ins issued in an earlier step
    (engine/kv/swap.py's staging); the step that admits it is the first to read them."""
    staged_hits: list[int] = field(default_factory=list)
    """The prefix cache's host-tier uids a staged sequence paged in: cached on the device again at its
    admission (not before: the data lands only then)."""
    constraint: Constraint | None = None
    """The sample's grammar state (sampling.json_schema, regex, choice or grammar), fed each generated token."""
    caching: bool = True
    """False once a page of this sequence could not be cached (another page holds its key): later pages would
    chain from an uncached parent, so they are not cached either."""
    scores: dict[int, "TokenScore"] = field(default_factory=dict)
    """Prompt position -> the score of the token there (Request.first_scored onwards), written as the steps that
    compute the position before it land (a recomputed position is written again with the same bits)."""

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def num_pending(self) -> int:
        """Tokens not yet in the cache; the last one's logits give the next token."""
        return len(self.token_ids) - self.num_computed

    @property
    def finished(self) -> bool:
        return self.stop.decision is not None

    def append(self, token_id: int, logprob: float) -> StopDecision | None:
        """Add one generated token; returns the stop decision when it ends the sample."""
        self.token_ids.append(token_id)
        self.logprobs.append(logprob)
        decision = self.stop.push(self.token_ids)
        if self.constraint is not None and (decision is None or decision.finish_reason == "length"):
            if self.constraint.advance(token_id):  # the grammar is complete: nothing more may follow
                return self.stop.grammar_complete(decision)
        return decision

    def score_targets(self, start: int, num_tokens: int) -> tuple[int, tuple[int, ...]]:
        """The tokens a chunk `start .. start + num_tokens - 1` scores: (the chunk offset of the first token whose
        logits score one, the prompt token ids they score: position p's logits score the token at p + 1)."""
        first = self.request.first_scored
        if first is None:
            return 0, ()
        lo = max(start, first - 1)
        hi = min(start + num_tokens, self.num_prompt_tokens - 1)
        return (lo - start, tuple(self.token_ids[lo + 1:hi + 1])) if lo < hi else (0, ())

    def tokens_left(self, max_seq_len: int) -> int:
        """Tokens the sequence may still generate: a decode step at position p (< max_seq_len) generates the
        token at p + 1, and no sample generates past sampling.max_new_tokens."""
        generated = len(self.token_ids) - self.num_prompt_tokens
        return min(self.request.sampling.max_new_tokens - generated, max_seq_len - len(self.token_ids) + 1)

    @property
    def num_pages(self) -> int:
        """Pages the sequence has in each group (given back or not)."""
        return len(self.pages[0]) if self.pages else 0

    def pages_short(self, num_tokens: int, page_size: int) -> int:
        """Pages (of each group) the sequence lacks to hold `num_tokens` tokens past its computed ones."""
        return max(0, pages_for(self.num_computed + num_tokens, page_size) - self.num_pages)


@dataclass(frozen=True)
class Chunk:
    """The scheduler's own record of a chunk it scheduled: new tokens of a live sequence,
    `token_ids[start:start + num_tokens]` (engine/scheduling/scheduler_output.py's ScheduledChunk is the plain copy the
    runner gets)."""

    seq: Sequence
    start: int  # the sequence's computed tokens when scheduled
    num_tokens: int
    completes: bool  # the chunk reaches the sequence's last token, so its logits pick the next token

    @classmethod
    def of(cls, seq: Sequence, num_tokens: int) -> "Chunk":
        return cls(seq, seq.num_computed, num_tokens, seq.num_computed + num_tokens == len(seq.token_ids))


def take_scores(seqs: list[Sequence], chunks, scores) -> None:
    """Write a ragged step's scored tokens (`ScoredTokens`, chunk by chunk) into the sequences of its chunks
    (`seqs[i]` scheduled `chunks[i]`, a ScheduledChunk)."""
    logprobs, is_argmax = scores.logprobs.tolist(), scores.is_argmax.tolist()
    q = 0
    for seq, c in zip(seqs, chunks):
        for j in range(len(c.score_targets)):
            top = tuple(zip(scores.top_ids[q, :c.num_top].tolist(), scores.top_logprobs[q, :c.num_top].tolist()))
            seq.scores[c.start + c.score_offset + j + 1] = TokenScore(logprobs[q], bool(is_argmax[q]), top)
            q += 1
