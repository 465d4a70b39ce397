"""The one small dataclass between host policy and device math: a ragged step, padded to its bucket."""

from __future__ import annotations

import equinox as eqx
import jax


class StepInputs(eqx.Module):
    """A ragged batch of new tokens from many sequences (prompt chunks and decode tokens mixed).

    T is the token bucket, S the sequence bucket, P the page-table width. Row s of the
    per-sequence arrays describes the s-th sequence present; rows >= num_seqs are padding.
    """

    token_ids: jax.Array  # i32[T]  new tokens; padding rows hold 0
    positions: jax.Array  # i32[T]  absolute position of each new token in its sequence
    slot_mapping: jax.Array  # i32[T]  page * page_size + offset where the token's K/V go; padding: out of range
    cu_q_lens: jax.Array  # i32[S + 1]  sequence s owns rows cu_q_lens[s]:cu_q_lens[s+1]
    kv_lens: jax.Array  # i32[S]  cached tokens after this step (new tokens included)
    page_indices: jax.Array  # i32[S, P]  each sequence's pages in order (within one layer's pool)
    num_seqs: jax.Array  # i32[1]
    logits_indices: jax.Array  # i32[R]  token row whose logits feed output row r (R >= S when samples share a prompt)
