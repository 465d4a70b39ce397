"""The Pallas TPU ragged paged attention kernel, run on CPU in JAX's TPU interpret mode, against the blocked JAX
reference (itself checked against dense attention in test_attention.py) at 1e-5 in float32.

The kernel runs through `tests/engine/kernels/pallas_interpret.py`, which fixes two faults of JAX 0.10.2's TPU
interpreter that stop this kernel (reads through a reshaped ref, masked stores); see its docstring. Interpreting
is slow (every load, store and DMA is a host callback): one small batch runs in the default suite, the rest of
the matrix is marked slow.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention as kernel

from engine.kernels.attention import reference_ragged_paged_attention
from tests.engine.kernels.pallas_interpret import tpu_interpret

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 128  # the kernel works in 128-lane rows: heads of 128


def ragged_batch(seqs: list[tuple[int, int]], page_size: int, max_seqs: int, seed: int = 0):
    """Inputs for sequences of (new tokens, tokens in the cache after this step), in scattered pages; rows past
    len(seqs) are padding. Returns the kernel's arguments and the number of real query rows."""
    rng = np.random.default_rng(seed)
    pages_per_seq = max(-(-kv // page_size) for _, kv in seqs) + 1
    num_pages = max_seqs * pages_per_seq + 3
    order = rng.permutation(num_pages)
    page_indices = np.zeros((max_seqs, pages_per_seq), np.int32)
    kv_lens = np.zeros(max_seqs, np.int32)
    cu = np.zeros(max_seqs + 1, np.int32)
    for s, (q_len, kv_len) in enumerate(seqs):
        page_indices[s] = order[s * pages_per_seq:(s + 1) * pages_per_seq]
        kv_lens[s] = kv_len
        cu[s + 1] = cu[s] + q_len
    cu[len(seqs) + 1:] = cu[len(seqs)]
    tokens = int(cu[len(seqs)])
    q = rng.standard_normal((tokens, HEADS, HEAD_DIM)).astype(np.float32)
    kv_pages = rng.standard_normal((num_pages, page_size, 2 * KV_HEADS, HEAD_DIM)).astype(np.float32)
    args = tuple(jnp.asarray(x) for x in (q, kv_pages, kv_lens, page_indices, cu, np.array([len(seqs)], np.int32)))
    return args, tokens


def check(seqs, page_size, *, sliding_window=None, soft_cap=None, kv_pages_per_block=2, queries_per_block=8,
          max_seqs=6):
    args, rows = ragged_batch(seqs, page_size, max_seqs)
    scale = HEAD_DIM**-0.5
    with tpu_interpret():
        out = kernel(*args, sm_scale=scale, sliding_window=sliding_window, soft_cap=soft_cap,
                     num_kv_pages_per_block=kv_pages_per_block, num_queries_per_block=queries_per_block)
    ref = reference_ragged_paged_attention(*args, sm_scale=scale, sliding_window=sliding_window, soft_cap=soft_cap)
    np.testing.assert_allclose(np.asarray(out)[:rows], np.asarray(ref)[:rows], atol=1e-5, rtol=0)


# (new tokens, cached tokens after the step): a whole short prompt, a prompt chunk after 25 cached tokens,
# two decoding sequences (one at its first token); two padding rows.
MIXED = [(9, 9), (5, 30), (1, 23), (1, 1)]


def test_mixed_prefill_and_decode():
    check(MIXED, page_size=16)


@pytest.mark.slow
@pytest.mark.parametrize("page_size", [8, 32])
def test_mixed_batches_at_other_page_sizes(page_size):
    check(MIXED, page_size=page_size, kv_pages_per_block=4 if page_size == 8 else 1)


@pytest.mark.slow
def test_decode_only():
    check([(1, 40), (1, 3), (1, 17), (1, 64)], page_size=16, queries_per_block=4)


@pytest.mark.slow
@pytest.mark.parametrize("page_size", [8, 16])
def test_sliding_window(page_size):
    check([(12, 40), (1, 37), (3, 3)], page_size=page_size, sliding_window=8)


def test_soft_cap_with_a_sliding_window():
    """Gemma 2's attention: scores soft-capped (C * tanh(s / C)) and a window shorter than the contexts; the
    kernel's score order (scale, cap, mask) is the reference's."""
    check([(12, 40), (1, 37), (3, 3)], page_size=16, sliding_window=8, soft_cap=0.7)
