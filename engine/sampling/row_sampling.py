"""How each row of a step picks its next token, on the host side: a sequence's settings (`RowSampling`), the
program variant a step needs (`sampling_mode`) and the padded per-row arrays the device reads
(`sampling_arrays`). The device side is engine/sampling/sampler.py; engine/device/runner.py calls both. No device work here."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from engine.config import penalizes
from engine.sampling.structured import Constraint
from engine.scheduling.sequence import Sequence as Seq


@dataclass(frozen=True)
class RowSampling:
    """How to pick the next token of one sequence (a row of the step)."""

    temperature: float
    top_k: int
    top_p: float
    base_key: np.ndarray  # u32[2] from (seed, prompt_id, generation_index)
    position: int  # index the new token will take in its sequence (prompt included)
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop_token_ids: tuple[int, ...] = ()  # the row's own stop ids, besides the engine's (multi-step calls)
    history: tuple[int, ...] = ()  # prompt then generated tokens (`position` of them); read only when penalizing
    num_prompt_tokens: int = 0
    constraint: Constraint | None = field(default=None, compare=False)  # the row's grammar state (structured outputs)
    min_tokens_end: int = 0  # the first position at which a stop id may be drawn (sampling.min_tokens); 0: any
    ignore_eos: bool = False  # the engine's EOS ids do not stop the row (multi-step calls)

    @property
    def holds_stops(self) -> bool:
        """Whether this row's stop ids are held back at its next token (sampling.min_tokens not yet generated)."""
        return self.position < self.min_tokens_end

    @property
    def penalizes(self) -> bool:
        return penalizes(self.repetition_penalty, self.presence_penalty, self.frequency_penalty)


def row_sampling(seq: Seq) -> RowSampling:
    """How the sequence's next token (at index len(token_ids)) is drawn."""
    s = seq.request.sampling
    return RowSampling(s.draw_temperature, s.top_k, s.top_p, seq.base_key, len(seq.token_ids), s.min_p,
                       s.repetition_penalty, s.presence_penalty, s.frequency_penalty, tuple(s.stop_token_ids),
                       tuple(seq.token_ids) if s.penalizes else (), seq.num_prompt_tokens, seq.constraint,
                       0 if seq.request.is_scored else seq.num_prompt_tokens + s.min_tokens, s.ignore_eos)


def sampling_mode(rows: Sequence[RowSampling], vocab_size: int) -> str:
    """What a step's program must be able to do: `greedy` (every row is greedy), `sample` (no sampled row
    truncates) or `truncate` (top-k or top-p). A job's steps all share one mode, so it compiles one variant;
    the sampler is about half of a step program's compile time, the sort most of that. A row truncates by
    the test `sample` applies on the device (`truncates`). `+min_p` adds min-p (a sampled row has it) and
    `+penalties` the penalties (a row has one), `+mask` an allowed-token mask (a row has a structured output) and
    `+min_tokens` stop ids held back (a row has not generated its sampling.min_tokens yet); without them the
    programs are those of a run without any."""
    penalties = ("+penalties" if any(r.penalizes for r in rows) else "") + (
        "+mask" if any(r.constraint is not None for r in rows) else "") + (
        "+min_tokens" if any(r.holds_stops for r in rows) else "")
    sampled = [r for r in rows if r.temperature > 0]
    if not sampled:
        return "greedy" + penalties
    min_p = "+min_p" if any(r.min_p > 0 for r in sampled) else ""
    if min_p or any(0 < r.top_k < vocab_size or r.top_p < 1.0 for r in sampled):
        return "truncate" + min_p + penalties
    return "sample" + penalties


def sampling_arrays(rows: Sequence[RowSampling], size: int) -> tuple[np.ndarray, ...]:
    """Temperature f32[size], top_k i32[size], top_p f32[size], min_p f32[size] and base keys u32[size, 2] of the
    rows, padded with greedy rows (their tokens are never read)."""
    pad = size - len(rows)
    keys = np.zeros((size, 2), np.uint32)
    keys[:len(rows)] = [r.base_key for r in rows]
    return (np.array([r.temperature for r in rows] + [0.0] * pad, np.float32),
            np.array([r.top_k for r in rows] + [0] * pad, np.int32),
            np.array([r.top_p for r in rows] + [1.0] * pad, np.float32),
            np.array([r.min_p for r in rows] + [0.0] * pad, np.float32), keys)
