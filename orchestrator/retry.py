"""How failed batches are retried."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RetryConfig:
    max_attempts: int = 3
    """Attempts per batch before it is marked failed."""
    backoff_s: float = 1.0
    """First wait between attempts, in seconds; doubles each retry."""

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"retry.max_attempts must be at least 1, got {self.max_attempts}")
