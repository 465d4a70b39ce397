"""The capacity report that `plan` prints: what was read, what was rejected, how well it packed."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field

import numpy as np

from orchestrator.plan.packing import Packing


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
    """Prompt tokens in full leading pages that an earlier prompt also has: what a prefix cache may serve
    (packing.shareable_prompt_tokens). Batches are sized without counting on it."""

    @classmethod
    def build(cls, rows_read: int, rejected_reasons: list[str], lengths: np.ndarray, packing: Packing,
              lower_bound: int, shareable_prompt_tokens: int = 0) -> PlanStats:
        hist: list[list[int]] = []
        if len(lengths):
            edges = 2 ** np.arange(0, int(np.ceil(np.log2(max(2, int(lengths.max()) + 1)))) + 1)
            counts, _ = np.histogram(lengths, bins=edges)
            hist = [[int(a), int(b), int(c)] for a, b, c in zip(edges[:-1], edges[1:], counts) if c]
        return cls(
            rows_read=rows_read,
            accepted=len(lengths),
            rejected=dict(sorted(Counter(rejected_reasons).items())),
            num_batches=packing.num_batches,
            lower_bound=lower_bound,
            prompts_per_batch=_spread(np.diff(packing.offsets)),
            pages_per_batch=_spread(packing.num_pages),
            prefill_tokens_per_batch=_spread(packing.num_prompt_tokens),
            total_prompt_tokens=int(lengths.sum()),
            length_histogram=hist,
            shareable_prompt_tokens=shareable_prompt_tokens,
        )

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
