"""Per-call performance: step wall times and the tokens each step carried."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np


@dataclass
class EngineStats:
    step_s: list[float] = field(default_factory=list)
    prefill_tokens: list[int] = field(default_factory=list)  # prompt (and recomputed) tokens per step
    decode_tokens: list[int] = field(default_factory=list)  # tokens drawn per step (all of a multi-step call's)
    active_seqs: list[int] = field(default_factory=list)
    model_steps: list[int] = field(default_factory=list)  # forward passes per step: > 1 for a multi-step decode call

    def clear(self) -> None:
        for values in (self.step_s, self.prefill_tokens, self.decode_tokens, self.active_seqs, self.model_steps):
            values.clear()

    def summary(self, max_seqs: int) -> dict[str, float]:
        """p50/p90/max step time (ms), prefill and decode tokens/s, mean slot occupancy (fraction of max_seqs),
        mean forward passes per step (device call)."""
        if not self.step_s:
            return {"steps": 0}
        t = np.asarray(self.step_s)
        total = float(t.sum())
        return {
            "steps": len(t),
            "step_ms_p50": float(np.percentile(t, 50) * 1e3),
            "step_ms_p90": float(np.percentile(t, 90) * 1e3),
            "step_ms_max": float(t.max() * 1e3),
            "prefill_tokens_per_s": sum(self.prefill_tokens) / total,
            "decode_tokens_per_s": sum(self.decode_tokens) / total,
            "mean_slot_occupancy": float(np.mean(self.active_seqs)) / max_seqs,
            "mean_model_steps": float(np.mean(self.model_steps)),
        }


class StepTimer:
    """Context manager that records one step (one device call) into EngineStats.

    A multi-step decode call sets `decode_tokens` (every token it generated) and `model_steps` before the
    block ends; otherwise each chunk that completes (and each sibling forking from it) drew one token in one
    forward pass.
    """

    def __init__(self, stats: EngineStats, chunks) -> None:
        self.stats = stats
        self.chunks = chunks
        self.decode_tokens: int | None = None
        self.model_steps = 1

    def __enter__(self) -> "StepTimer":
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.stats.step_s.append(time.perf_counter() - self.start)
        # A chunk that completes draws a token, and so does each sibling forking from it (same logits).
        completed = sum(1 + len(c.seq.siblings) for c in self.chunks if c.completes)
        self.stats.decode_tokens.append(completed if self.decode_tokens is None else self.decode_tokens)
        self.stats.prefill_tokens.append(sum(c.num_tokens for c in self.chunks if c.num_tokens > 1 or not c.completes))
        self.stats.active_seqs.append(len(self.chunks))
        self.stats.model_steps.append(self.model_steps)
