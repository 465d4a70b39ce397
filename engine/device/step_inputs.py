"""Between host policy and device math: the chunks of new tokens a step computes (SeqChunk) and the ragged step they
pack into, padded to its bucket (StepInputs)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import equinox as eqx
import jax
import numpy as np


@dataclass(frozen=True)
class SeqChunk:
    """New tokens of one sequence for one step."""

    token_ids: Sequence[int]
    start: int  # position of the first new token = tokens of this sequence already in the cache
    # The sequence's pages in each KV layer group (`group_pages`: a flat list for one group), each list covering at
    # least start + len(token_ids) tokens; kv_groups.NONE for a page slid out of its group's window.
    pages: Sequence[Sequence[int]] | Sequence[int]
    # The sequence's prompt tokens: its tokens at positions from here on were generated (StepInputs.generated).
    # None: every token is a prompt token.
    num_prompt_tokens: int | None = None

    @property
    def prompt_end(self) -> int:
        """The sequence's first generated position (past any position when every token is a prompt token)."""
        return np.iinfo(np.int32).max if self.num_prompt_tokens is None else self.num_prompt_tokens


class StepInputs(eqx.Module):
    """A ragged batch of new tokens from many sequences (prompt chunks and decode tokens mixed).

    T is the token bucket, S the sequence bucket, P the page-table width, G the KV layer groups (one page table
    each: engine/kv/kv_groups.py; 1 for a model whose layers share one). Row s of the per-sequence arrays
    describes the s-th sequence present; rows >= num_seqs are padding.
    """

    token_ids: jax.Array  # i32[T]  new tokens; padding rows hold 0
    positions: jax.Array  # i32[T]  absolute position of each new token in its sequence
    # i32[G, T]  unit * page_size + offset where the token's K/V go in each group (`token_slots`); padding: out of
    # range (units * page_size or more)
    slot_mapping: jax.Array
    cu_q_lens: jax.Array  # i32[S + 1]  sequence s owns rows cu_q_lens[s]:cu_q_lens[s+1]
    kv_lens: jax.Array  # i32[S]  cached tokens after this step (new tokens included)
    # i32[G, S, P]  each sequence's units in order in each group's table (within one slot of the pool); a page the
    # sequence no longer holds (kv_groups.NONE) is 0 here: no kernel reads a block wholly before a query's window
    page_indices: jax.Array
    num_seqs: jax.Array  # i32[1]
    logits_indices: jax.Array  # i32[R]  token row whose logits feed output row r (R >= S when samples share a prompt)
    # bool[T]  the token was generated: its position is past its sequence's prompt (a mixture of experts computes
    # a generated token's experts in matmuls of another size than a prompt token's, engine/models/moe.py); padding:
    # False
    generated: jax.Array


def group_pages(pages: Sequence, num_groups: int) -> Sequence[Sequence[int]]:
    """A sequence's page lists, one per KV layer group: `pages` itself, or, for one group, a flat list of ints as
    that group's list (tests, models of one attention kind); an empty `pages` is an empty list in every group."""
    if len(pages) == 0:
        return [()] * num_groups
    if num_groups == 1 and isinstance(pages[0], (int, np.integer)):
        return [pages]
    if len(pages) != num_groups:
        raise ValueError(f"{len(pages)} page lists for {num_groups} KV layer groups")
    return pages


def token_slots(page_table, rows, positions, page_size: int):
    """Where tokens' K/V go in every group: i32[G, n] from page_table i32[G, S, P] (numpy or jax), the tokens'
    sequence rows i32[n] and positions i32[n]. A NONE entry gives a negative slot."""
    return page_table[:, rows, positions // page_size] * page_size + positions % page_size
