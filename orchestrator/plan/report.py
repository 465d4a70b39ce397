"""The capacity report that `plan` prints: what was read, what was rejected, how well it packed."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field

import numpy as np

from orchestrator.plan.packing import Packing, PackingLimits, lower_bound_of


def _spread(values: np.ndarray) -> list[float]:
    """[min, median, max], zeros when empty."""
    if len(values) == 0:
        return [0, 0, 0]
    return [int(values.min()), float(np.median(values)), int(values.max())]


@dataclass(frozen=True)
class PlanStats:
    rows_read: int
    accepted: int
    rejected: dict[str, int]
    """Rejected rows per reason."""
    num_batches: int
    lower_bound: int
    """Fewest batches any packing could use (largest of the page, prefill and count bounds)."""
    prompts_per_batch: list[float]
    """[min, median, max]."""
    pages_per_batch: list[float]
    prefill_tokens_per_batch: list[float]
    total_prompt_tokens: int
    length_histogram: list[list[int]] = field(default_factory=list)
    """[[lo, hi, count], ...] of accepted prompts' token counts, power-of-two buckets lo..hi-1."""
    shareable_prompt_tokens: int = 0
    """Prompt tokens in full leading pages that an earlier prompt of the same planning window also has: what a prefix
    cache may serve (packing.shareable_prompt_tokens; pages shared only across windows are not counted). Batches are
    sized without counting on it."""

    @property
    def efficiency_ratio(self) -> float:
        """Batches over the lower bound (1.0 is perfect)."""
        return self.num_batches / self.lower_bound if self.lower_bound else 1.0

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> PlanStats:
        return cls(**data)

    def format(self) -> str:
        def spread(name: str, v: list[float]) -> str:
            return f"  {name:<24} min {v[0]:>8,}  median {v[1]:>10,.1f}  max {v[2]:>8,}"

        lines = [
            f"rows read        {self.rows_read:>12,}",
            f"accepted         {self.accepted:>12,}",
            f"rejected         {sum(self.rejected.values()):>12,}",
        ]
        lines += [f"  {reason:<22} {count:>8,}" for reason, count in self.rejected.items()]
        lines += [
            f"prompt tokens    {self.total_prompt_tokens:>12,}",
            f"  shareable      {self.shareable_prompt_tokens:>12,} "
            f"({self.shareable_prompt_tokens / max(self.total_prompt_tokens, 1):.1%}; full leading pages shared "
            "with an earlier prompt: a prefix cache may serve them, batches are sized without them)",
            f"batches          {self.num_batches:>12,}",
            spread("prompts per batch", self.prompts_per_batch),
            spread("pages per batch", self.pages_per_batch),
            spread("prefill tokens per batch", self.prefill_tokens_per_batch),
            f"packing efficiency: {self.num_batches:,} batches / lower bound {self.lower_bound:,} = "
            f"{self.efficiency_ratio:.3f}",
        ]
        if self.length_histogram:
            lines.append("prompt length (tokens)")
            peak = max(c for _, _, c in self.length_histogram)
            for lo, hi, count in self.length_histogram:
                lines.append(f"  {lo:>6}-{hi - 1:<6} {count:>10,} {'#' * max(1, round(40 * count / peak))}")
        return "\n".join(lines)


@dataclass
class PlanTally:
    """The report's figures gathered window by window (the planner packs the corpus a window of rows at a time): counts,
    a power-of-two length histogram and the per-batch figures, never a row's own."""

    rows_read: int = 0
    rejected: Counter = field(default_factory=Counter)
    accepted: int = 0
    total_prompt_tokens: int = 0
    length_counts: np.ndarray = field(default_factory=lambda: np.zeros(64, np.int64))
    """Accepted prompts whose length has k + 1 binary digits (2**k <= length < 2**(k + 1)), by k."""
    bound_totals: np.ndarray = field(default_factory=lambda: np.zeros(4, np.int64))
    """packing.bound_totals summed over the windows."""
    shareable_prompt_tokens: int = 0
    per_batch: list[np.ndarray] = field(default_factory=list)
    """Each window's [prompts, pages, prefill tokens] per batch (int64[3, batches])."""

    def add(self, rows_read: int, rejected_reasons: list[str], lengths: np.ndarray, packing: Packing,
            bound_totals: np.ndarray, shareable_prompt_tokens: int = 0) -> PlanTally:
        """Count one window: its rows, its rejections' reasons, its accepted prompts' lengths and its packing."""
        self.rows_read += rows_read
        self.rejected.update(rejected_reasons)
        lengths = np.asarray(lengths, dtype=np.int64)
        self.accepted += len(lengths)
        self.total_prompt_tokens += int(lengths.sum())
        positive = lengths[lengths > 0]
        self.length_counts += np.bincount(np.floor(np.log2(positive)).astype(np.int64), minlength=64)[:64]
        self.bound_totals += bound_totals
        self.shareable_prompt_tokens += shareable_prompt_tokens
        self.per_batch.append(np.stack([np.diff(packing.offsets), packing.num_pages, packing.num_prompt_tokens])
                              .astype(np.int64).reshape(3, -1))
        return self

    def stats(self, limits: PackingLimits) -> PlanStats:
        per_batch = np.concatenate(self.per_batch, axis=1) if self.per_batch else np.zeros((3, 0), np.int64)
        return PlanStats(
            rows_read=self.rows_read,
            accepted=self.accepted,
            rejected=dict(sorted(self.rejected.items())),
            num_batches=per_batch.shape[1],
            lower_bound=lower_bound_of(self.bound_totals, limits),
            prompts_per_batch=_spread(per_batch[0]),
            pages_per_batch=_spread(per_batch[1]),
            prefill_tokens_per_batch=_spread(per_batch[2]),
            total_prompt_tokens=self.total_prompt_tokens,
            length_histogram=[[2 ** k, 2 ** (k + 1), int(c)] for k, c in enumerate(self.length_counts) if c],
            shareable_prompt_tokens=self.shareable_prompt_tokens,
        )
