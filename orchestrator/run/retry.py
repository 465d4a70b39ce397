"""How failed batches are retried: attempts per batch and an exponential backoff (tenacity's policy)."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace


@dataclass(frozen=True)
class RetryConfig:
    max_attempts: int = 3
    """Attempts per batch (in one `pagefleet run`) before it is marked failed; a new run retries failed batches."""
    backoff_s: float = 1.0
    """First wait before a failed batch is retried, in seconds; doubles each retry."""
    max_backoff_s: float = 60.0
    """Longest wait between attempts, in seconds."""

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"retry.max_attempts must be at least 1, got {self.max_attempts}")
        if self.backoff_s < 0 or self.max_backoff_s < 0:
            raise ValueError("retry.backoff_s and retry.max_backoff_s must be >= 0")

    def wait_s(self, attempt: int) -> float:
        """Seconds to wait after the `attempt`-th failure (1-based)."""
        from tenacity import wait_exponential

        wait = wait_exponential(multiplier=self.backoff_s, max=self.max_backoff_s)
        return float(wait(SimpleNamespace(attempt_number=attempt)))
