"""One sample being generated: its tokens, how many are in the KV cache, its pages, its stop state."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from engine.config import SamplingConfig
from engine.stop import StopChecker


@dataclass(frozen=True)
class Request:
    """One sample to generate: (prompt_id, generation_index) names it and seeds its random stream."""

    prompt_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingConfig
    generation_index: int = 0


@dataclass(eq=False)  # a sequence is a mutable state: the scheduler's `in` and `remove` compare identity
class Sequence:
    request: Request
    arrival: int  # admission order (FIFO); preempted sequences keep theirs
    base_key: np.ndarray  # u32[2] from (seed, prompt_id, generation_index)
    stop: StopChecker
    token_ids: list[int] = field(default_factory=list)  # prompt followed by generated tokens
    logprobs: list[float] = field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V are in the cache
    pages: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    siblings: list["Sequence"] = field(default_factory=list)
    """Other samples of the same prompt, waiting to fork from this one when its prompt is computed."""

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def num_pending(self) -> int:
        """Tokens not yet in the cache; the last one's logits give the next token."""
        return len(self.token_ids) - self.num_computed

    @property
    def finished(self) -> bool:
        return self.stop.finished
