"""The samples of one prompt (`sampling.n` > 1): forked off the sequence that computes the prompt, in the step that
completes it. Part of the scheduler. No JAX here.

The scheduler queues the other samples of a prompt as the siblings of its first (Scheduler.add: one prompt is
computed once, and their slots are reserved at its admission); the step that completes the prompt gives each
sibling an output row that samples its first token from the same logits, each with its own key.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.kv.kv_cache_manager import KVCacheManager
from engine.scheduling.sequence import Chunk, Sequence


@dataclass
class Forks:
    """A ragged step's output rows and the siblings forked in it."""

    rows: list[Sequence]  # one per chunk, plus one per sibling of a prompt completed now
    row_chunk: list[int]  # the chunk each row samples from
    running: list[Sequence]  # siblings forked: they run from the next step
    requeued: list[Sequence]  # siblings with no page free for their copy: back to the queue


def fork(chunks: list[Chunk], kv: KVCacheManager) -> Forks:
    """Output rows of a single step, and the page copies that fork siblings off their parents.

    One row per chunk, plus one per sibling of a sequence whose prompt completes now. A sibling shares its
    parent's full prompt pages and gets a copy (made after the step, `KVCacheManager.fork`) of the partial last
    one; with no page free for that copy it goes back to the queue and computes its prompt alone (its row is
    drawn and dropped)."""
    rows, row_chunk, forks = [], [], []
    for i, c in enumerate(chunks):
        rows.append(c.seq)
        row_chunk.append(i)
        if c.completes and c.seq.siblings and len(c.seq.token_ids) == c.seq.num_prompt_tokens:
            forks.append(c.seq)
            rows += c.seq.siblings
            row_chunk += [i] * len(c.seq.siblings)
    running, requeued = [], []
    for parent in forks:
        for sib in parent.siblings:
            if not kv.fork(parent, sib):
                requeued.append(sib)
                continue
            sib.num_computed = parent.num_prompt_tokens  # the parent's prompt, computed in this step
            sib.num_cached_pages, sib.caching = parent.num_cached_pages, False  # the parent caches them
            sib.scores = parent.scores  # its prompt's scores, which this step writes into the parent
            running.append(sib)  # its slot was counted at the parent's admission
        parent.siblings = []
    return Forks(rows, row_chunk, running, requeued)
