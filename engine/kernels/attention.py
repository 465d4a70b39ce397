"""Ragged paged attention over the KV page pool.

Layout (the same as the Pallas TPU kernel that ships with JAX, so dispatch needs no conversion):
    q:            f32|bf16[T, num_heads, head_dim]           new tokens of all sequences, concatenated
    kv_pages:     [num_pages, page_size, 2 * num_kv_heads, head_dim]   K and V interleaved per head (k0 v0 k1 v1 ...)
    kv_lens:      i32[S]          tokens in each sequence's cache, this step's new tokens included
    page_indices: i32[S, pages_per_seq]   the pages of each sequence, in order
    cu_q_lens:    i32[S + 1]      sequence s owns q rows cu_q_lens[s]:cu_q_lens[s+1]
    num_seqs:     i32[1]          sequences actually present (rows past it are padding)
Query head h reads KV head h // (num_heads // num_kv_heads), as in Hugging Face's GQA.
A query at position p (its sequence's new tokens sit at the end of its kv_len) attends to cached
positions k <= p, and with a sliding window W only to p - k < W.
Scores are computed in one order in every implementation: s = (q * sm_scale) . k, then with logit
soft-capping (Gemma 2's `attn_logit_softcapping`, C) s = C * tanh(s / C), then the mask.
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp

logger = logging.getLogger(__name__)

_MASKED = -1e30  # finite, so an all-masked block never produces inf - inf


def write_kv(kv_pages: jax.Array, k: jax.Array, v: jax.Array, slot_mapping: jax.Array) -> jax.Array:
    """Write new tokens' K/V into the pool; slot s is page s // page_size, offset s % page_size.

    k, v: [T, num_kv_heads, head_dim]; slot_mapping: i32[T]; a slot >= num_pages * page_size
    (padding tokens) is dropped.
    """
    num_pages, page_size, combined, head_dim = kv_pages.shape
    kv = jnp.stack([k, v], axis=2).reshape(k.shape[0], combined, head_dim).astype(kv_pages.dtype)
    flat = kv_pages.reshape(num_pages * page_size, combined, head_dim)
    flat = flat.at[slot_mapping].set(kv, mode="drop")
    return flat.reshape(kv_pages.shape)


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap", "pages_per_block",
                                             "queries_per_block", "tiles_per_group"))
def reference_ragged_paged_attention(
    q: jax.Array,
    kv_pages: jax.Array,
    kv_lens: jax.Array,
    page_indices: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    pages_per_block: int = 8,
    queries_per_block: int = 16,
    tiles_per_group: int = 8,
) -> jax.Array:
    """Blocked ragged paged attention in plain JAX: online softmax over blocks of pages.

    Work is cut into tiles of up to `queries_per_block` query rows of one sequence (a decoding sequence's one
    new token is a tile of its own). A tile visits only the KV blocks its queries can see (up to its last
    query's position; with a sliding window, from the first block inside its first query's window), so a short
    or early tile costs little next to a long one. Tiles are sorted by that count and processed
    `tiles_per_group` at a time, each group for as many blocks as its busiest tile needs: one loop walks every
    (group, block) pair. A tile always visits its blocks in order and skipped blocks are ones it would have
    masked whole, so its result does not depend on which tiles share its group.

    A query row's bits depend on nothing but its sequence: every tile has the same shape (`queries_per_block`
    rows, blocks of `pages_per_block` pages) in every kind of step, because XLA's CPU dot rounds a row of a
    one-row product differently from the same row in a 16-row one, and an online softmax over other block
    boundaries rounds differently too. So a token's KV recomputed in a prompt step after a preemption, or a
    suffix computed after cached pages, is the KV its decode step wrote, bit for bit. Returns
    [T, num_heads, head_dim] in q's dtype; rows that belong to no sequence are zero.
    """
    num_tokens = q.shape[0]
    max_seqs = page_indices.shape[0]
    present = jnp.arange(max_seqs) < num_seqs[0]
    # Sum of ceil(q_len / bq) over at most min(S, T) non-empty sequences.
    max_tiles = (num_tokens + min(max_seqs, num_tokens) * (queries_per_block - 1)) // queries_per_block
    return _attend(q, kv_pages, kv_lens, page_indices, cu_q_lens, present, sm_scale=sm_scale,
                   sliding_window=sliding_window, soft_cap=soft_cap, pages_per_block=pages_per_block,
                   queries_per_block=queries_per_block, tiles_per_group=tiles_per_group, max_tiles=max_tiles)


def _attend(q, kv_pages, kv_lens, page_indices, cu_q_lens, included, *, sm_scale, sliding_window, soft_cap,
            pages_per_block, queries_per_block, tiles_per_group, max_tiles) -> jax.Array:
    """Attention for the `included` sequences' query rows (the other rows stay zero), in tiles of
    `queries_per_block` rows, at most `max_tiles` of them."""
    num_tokens, num_heads, head_dim = q.shape
    num_pages, page_size, combined, _ = kv_pages.shape
    num_kv_heads = combined // 2
    q_per_kv = num_heads // num_kv_heads
    max_seqs, pages_per_seq = page_indices.shape
    bq = queries_per_block
    block_tokens = pages_per_block * page_size

    q_lens = jnp.where(included, cu_q_lens[1:] - cu_q_lens[:-1], 0)  # i32[S]
    kv_lens = jnp.where(included, kv_lens, 0)
    tiles_per_seq = (q_lens + bq - 1) // bq
    tile_end = jnp.cumsum(tiles_per_seq)
    group = min(tiles_per_group, max_tiles)  # tiles are padded to whole groups
    num_tiles = -(-max_tiles // group) * group
    tile = jnp.arange(num_tiles)
    tile_seq = jnp.minimum(jnp.searchsorted(tile_end, tile, side="right"), max_seqs - 1)  # i32[tiles]
    tile_valid = tile < tile_end[-1]
    tile_local = tile - (tile_end[tile_seq] - tiles_per_seq[tile_seq])
    row = jnp.arange(bq)
    q_offset = tile_local[:, None] * bq + row[None, :]  # [tiles, bq] index among the sequence's new tokens
    row_valid = tile_valid[:, None] & (q_offset < q_lens[tile_seq][:, None])
    q_row = jnp.where(row_valid, cu_q_lens[tile_seq][:, None] + q_offset, num_tokens)  # T = dropped
    q_pos = (kv_lens[tile_seq] - q_lens[tile_seq])[:, None] + q_offset  # absolute position of each query row
    tile_kv_len = jnp.where(tile_valid, kv_lens[tile_seq], 0)

    # The blocks [first_block, end_block) each tile must visit.
    last_pos = jnp.max(jnp.where(row_valid, q_pos, -1), axis=1)
    end_block = (jnp.minimum(last_pos + 1, tile_kv_len) + block_tokens - 1) // block_tokens
    if sliding_window is None:
        first_block = jnp.zeros_like(end_block)
    else:  # blocks wholly before the tile's first query's window hold nothing any of its queries may see
        first_pos = jnp.min(jnp.where(row_valid, q_pos, jnp.iinfo(jnp.int32).max), axis=1)
        first_block = jnp.maximum(first_pos - sliding_window + 1, 0) // block_tokens
    work = jnp.maximum(end_block - first_block, 0)  # i32[tiles]
    order = jnp.argsort(-work, stable=True)  # busiest first: a group's first tile has its most work
    group_work = work[order[::group]]  # i32[groups]
    group_end = jnp.cumsum(group_work)

    kv_split = kv_pages.reshape(num_pages, page_size, num_kv_heads, 2, head_dim)  # free view: K at 0, V at 1
    qt = jnp.take(q, jnp.minimum(q_row, num_tokens - 1), axis=0).astype(jnp.float32)
    qt = (qt.reshape(num_tiles, bq, num_kv_heads, q_per_kv, head_dim) * sm_scale)[order]
    seq_s, first_s, work_s, pos_s, kv_len_s = (x[order] for x in (tile_seq, first_block, work, q_pos, tile_kv_len))

    def visit(i, carry):
        """The i-th (group, block) pair: one block of KV for each of the group's tiles."""
        m, l, acc = carry  # in sorted tile order; m, l: [tiles, kvh, g, bq]; acc: [tiles, kvh, g, bq, d]
        g = jnp.searchsorted(group_end, i, side="right")
        local = i - (group_end[g] - group_work[g])  # the group's block counter
        start = g * group

        def mine(x):
            return jax.lax.dynamic_slice_in_dim(x, start, group, axis=0)

        block = mine(first_s) + local  # i32[group] each tile's own block
        active = local < mine(work_s)  # a tile with fewer blocks than its group's busiest sits out
        page_slot = jnp.minimum(block[:, None] * pages_per_block + jnp.arange(pages_per_block), pages_per_seq - 1)
        pages = jnp.take_along_axis(page_indices[mine(seq_s)], page_slot, axis=1)  # [group, ppb]
        # One gather each for K and V straight from the interleaved pool: no combined copy to split.
        k = kv_split[pages, :, :, 0].reshape(group, block_tokens, num_kv_heads, head_dim).astype(jnp.float32)
        v = kv_split[pages, :, :, 1].reshape(group, block_tokens, num_kv_heads, head_dim).astype(jnp.float32)
        s = jnp.einsum("tqhgd,tkhd->thgqk", mine(qt), k)
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        kv_pos = block[:, None] * block_tokens + jnp.arange(block_tokens)  # [group, blk]
        pos = mine(pos_s)
        mask = ((kv_pos[:, None, :] <= pos[:, :, None]) & (kv_pos[:, None, :] < mine(kv_len_s)[:, None, None])
                & active[:, None, None])
        if sliding_window is not None:
            mask &= pos[:, :, None] - kv_pos[:, None, :] < sliding_window
        mask = mask[:, None, None]  # [group, 1, 1, bq, blk]
        s = jnp.where(mask, s, _MASKED)
        m_old = mine(m)
        m_new = jnp.maximum(m_old, s.max(axis=-1))
        p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
        alpha = jnp.exp(m_old - m_new)
        l_new = mine(l) * alpha + p.sum(axis=-1)
        acc_new = mine(acc) * alpha[..., None] + jnp.einsum("thgqk,tkhd->thgqd", p, v)

        def put(x, y):
            return jax.lax.dynamic_update_slice_in_dim(x, y, start, axis=0)

        return put(m, m_new), put(l, l_new), put(acc, acc_new)

    shape = (num_tiles, num_kv_heads, q_per_kv, bq)
    init = (jnp.full(shape, _MASKED, jnp.float32), jnp.zeros(shape, jnp.float32),
            jnp.zeros(shape + (head_dim,), jnp.float32))
    _, l, acc = jax.lax.fori_loop(0, group_end[-1], visit, init)
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]  # [tiles, kvh, g, bq, d], sorted order
    out = out.transpose(0, 3, 1, 2, 4).reshape(num_tiles * bq, num_heads, head_dim)
    result = jnp.zeros((num_tokens, num_heads, head_dim), q.dtype)
    return result.at[q_row[order].reshape(-1)].set(out.astype(q.dtype), mode="drop")


@functools.cache
def _log_choice_once(message: str) -> None:
    logger.warning(message)


def resolve_attention_impl(requested: str, dtype=jnp.float32) -> str:
    """Which implementation `auto` means on this backend for a pool of `dtype`; a fallback is logged once."""
    backend = jax.default_backend()
    if requested == "auto":
        if backend == "tpu":
            return "pallas_tpu"
        if backend == "cpu":
            reason = _cpu_kernel_problem(dtype)
            if reason is None:
                return "cpu_kernel"
            _log_choice_once(f"ragged paged attention: the native CPU kernel is not used ({reason}); "
                             "using the blocked JAX reference implementation")
            return "reference"
        _log_choice_once(f"ragged paged attention: no kernel for backend {backend!r}; "
                         "using the blocked JAX reference implementation")
        return "reference"
    if requested == "pallas_tpu" and backend != "tpu":
        raise ValueError(f"engine.attention_impl=pallas_tpu needs a TPU, but JAX's backend is {backend!r}; "
                         "use engine.attention_impl=auto or reference")
    if requested == "cpu_kernel":
        reason = "JAX's backend is " + repr(backend) if backend != "cpu" else _cpu_kernel_problem(dtype)
        if reason is not None:
            raise ValueError(f"engine.attention_impl=cpu_kernel is not available: {reason}; "
                             "use engine.attention_impl=auto or reference")
    return requested


def prepare_attention_impl(requested: str, dtype=jnp.float32) -> None:
    """Start what `resolve_attention_impl` will need (the CPU kernel's build) in the background."""
    if requested in ("auto", "cpu_kernel") and jax.default_backend() == "cpu" and jnp.dtype(dtype) == jnp.float32:
        from engine.kernels import cpu_attention
        cpu_attention.prepare_in_background()


def _cpu_kernel_problem(dtype) -> str | None:
    from engine.kernels import cpu_attention
    if not cpu_attention.supports(dtype, dtype):
        return f"it takes float32, the KV pool is {jnp.dtype(dtype).name}"
    return cpu_attention.unavailable_reason()


def ragged_paged_attention(
    q: jax.Array,
    kv_pages: jax.Array,
    kv_lens: jax.Array,
    page_indices: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float,
    sliding_window: int | None,
    impl: str,
    soft_cap: float | None = None,
    pages_per_block: int,
    queries_per_block: int,
    tiles_per_group: int = 8,
) -> jax.Array:
    """Dispatch to the Pallas TPU kernel, the native CPU kernel or the blocked reference (`impl` from
    `resolve_attention_impl`; block and tile sizes only shape the reference: the Pallas kernel's come from
    `engine.kernels.pallas_blocks`, for the TPU generation being traced for)."""
    if impl == "cpu_kernel":
        from engine.kernels import cpu_attention
        return cpu_attention.ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
                                                    sm_scale=sm_scale, sliding_window=sliding_window,
                                                    soft_cap=soft_cap)
    if impl == "pallas_tpu":
        from engine.kernels.pallas_blocks import kernel_blocks
        from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention as kernel

        blocks = kernel_blocks(q.shape, q.dtype, kv_pages.shape, kv_pages.dtype, page_indices.shape[1])
        return kernel(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale=sm_scale,
                      sliding_window=sliding_window, soft_cap=soft_cap, num_kv_pages_per_block=blocks.kv_pages_per_block,
                      num_queries_per_block=blocks.queries_per_block)
    return reference_ragged_paged_attention(
        q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale=sm_scale, sliding_window=sliding_window,
        soft_cap=soft_cap, pages_per_block=pages_per_block, queries_per_block=queries_per_block, tiles_per_group=tiles_per_group,
    )
