"""Ragged paged attention against dense causal attention (float32, 1e-5): the plain-JAX reference and the
native CPU kernel, through the engine's dispatch."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest

from engine.kernels import cpu_attention
from engine.kernels.attention import ragged_paged_attention, resolve_attention_impl, write_kv

NUM_KV_HEADS, Q_PER_KV, HEAD_DIM = 2, 3, 8
NUM_HEADS = NUM_KV_HEADS * Q_PER_KV
SCALE = HEAD_DIM**-0.5
IMPLS = ["reference", "cpu_kernel"]


@pytest.fixture(scope="module", autouse=True)
def cpu_kernel_built():
    """The kernel must build on the machines the tests run on (they have g++): a failure is a failure."""
    assert cpu_attention.unavailable_reason() is None, cpu_attention.unavailable_reason()


def dense_attention(q, k, v, q_positions, window=None, soft_cap=None):
    """q: [Q, H, d] at absolute q_positions; k, v: [K, kvh, d] at positions 0..K-1; scores soft-capped as
    transformers' Gemma 2 caps them (divide, tanh, multiply) before the mask."""
    k = np.repeat(k, Q_PER_KV, axis=1)
    v = np.repeat(v, Q_PER_KV, axis=1)
    s = np.einsum("qhd,khd->hqk", q, k) * SCALE
    if soft_cap is not None:
        s = soft_cap * np.tanh(s / soft_cap)
    kpos = np.arange(k.shape[0])
    mask = kpos[None, :] <= q_positions[:, None]
    if window is not None:
        mask &= q_positions[:, None] - kpos[None, :] < window
    s = np.where(mask[None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", p, v)


class PagedBatch:
    """Sequences laid out in scattered pages; feeds new tokens chunk by chunk."""

    def __init__(self, rng, seq_lens, page_size, num_pages, pages_per_seq):
        self.page_size = page_size
        self.k = [rng.standard_normal((n, NUM_KV_HEADS, HEAD_DIM)).astype(np.float32) for n in seq_lens]
        self.v = [rng.standard_normal((n, NUM_KV_HEADS, HEAD_DIM)).astype(np.float32) for n in seq_lens]
        self.q = [rng.standard_normal((n, NUM_HEADS, HEAD_DIM)).astype(np.float32) for n in seq_lens]
        perm = rng.permutation(num_pages)  # scattered, non-contiguous pages
        self.pages = np.zeros((len(seq_lens), pages_per_seq), np.int32)
        used = 0
        for s, n in enumerate(seq_lens):
            need = math.ceil(n / page_size)
            self.pages[s, :need] = perm[used:used + need]
            used += need
        self.kv_pages = jnp.zeros((num_pages, page_size, 2 * NUM_KV_HEADS, HEAD_DIM), jnp.float32)

    def step(self, chunks, max_seqs, bucket_tokens, impl="reference", sliding_window=None, soft_cap=None, **blocks):
        """chunks: list of (seq, start, end) new tokens; returns per-chunk outputs [end-start, H, d]."""
        q, k, v, slots, cu, kv_lens, pages = [], [], [], [], [0], [], []
        for s, a, b in chunks:
            q.append(self.q[s][a:b]); k.append(self.k[s][a:b]); v.append(self.v[s][a:b])
            pos = np.arange(a, b)
            slots.append(self.pages[s, pos // self.page_size] * self.page_size + pos % self.page_size)
            cu.append(cu[-1] + b - a); kv_lens.append(b); pages.append(self.pages[s])
        n = cu[-1]
        pad = bucket_tokens - n
        pad_rows = lambda x, w: np.concatenate([np.concatenate(x), np.zeros((pad,) + w, np.float32)])
        qa = pad_rows(q, (NUM_HEADS, HEAD_DIM))
        slot = np.concatenate(slots + [np.full(pad, self.kv_pages.shape[0] * self.page_size)]).astype(np.int32)
        self.kv_pages = write_kv(self.kv_pages, jnp.asarray(pad_rows(k, (NUM_KV_HEADS, HEAD_DIM))),
                                 jnp.asarray(pad_rows(v, (NUM_KV_HEADS, HEAD_DIM))), jnp.asarray(slot))
        ns = len(chunks)
        cu_a = np.array(cu + [n] * (max_seqs - ns), np.int32)
        kvl = np.array(kv_lens + [0] * (max_seqs - ns), np.int32)
        pg = np.zeros((max_seqs, self.pages.shape[1]), np.int32)
        pg[:ns] = np.stack(pages)
        blocks = dict(dict(pages_per_block=8, queries_per_block=16), **blocks)
        out = ragged_paged_attention(jnp.asarray(qa), self.kv_pages, jnp.asarray(kvl), jnp.asarray(pg),
                                     jnp.asarray(cu_a), jnp.array([ns], jnp.int32), sm_scale=SCALE,
                                     sliding_window=sliding_window, soft_cap=soft_cap, impl=impl, **blocks)
        out = np.asarray(out)
        assert np.all(out[n:] == 0), "padding rows must stay zero"
        return [out[cu[i]:cu[i + 1]] for i in range(ns)]

    def dense(self, s, a, b, window=None, soft_cap=None):
        return dense_attention(self.q[s][a:b], self.k[s][:b], self.v[s][:b], np.arange(a, b), window, soft_cap)


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("blocks", [(1, 1, 1), (2, 4, 3), (8, 16, 8)])
def test_ragged_batch_matches_dense(page_size, blocks, impl="reference"):
    pages_per_block, queries_per_block, tiles_per_group = blocks
    rng = np.random.default_rng(page_size * 100 + pages_per_block)
    seq_lens = [1, 2, 17, 33, 64, 5, 40, 23]
    pps = math.ceil(max(seq_lens) / page_size)
    batch = PagedBatch(rng, seq_lens, page_size, num_pages=sum(math.ceil(n / page_size) for n in seq_lens) + 7,
                       pages_per_seq=pps)
    # Step 1: prompts fed partially (prefill chunks of different sizes, one-token ones among them: the
    # one-query tiles), step 2: the rest.
    split = [max(1, n // 3) for n in seq_lens]
    first = [(s, 0, split[s]) for s in range(len(seq_lens))]
    outs = batch.step(first, max_seqs=10, bucket_tokens=128, impl=impl, pages_per_block=pages_per_block,
                      queries_per_block=queries_per_block, tiles_per_group=tiles_per_group)
    for (s, a, b), o in zip(first, outs):
        np.testing.assert_allclose(o, batch.dense(s, a, b), atol=1e-5, rtol=0)
    second = [(s, split[s], n) for s, n in enumerate(seq_lens) if n > split[s]]
    rng.shuffle(second)  # sequence order in a step is arbitrary
    outs = batch.step(second, max_seqs=10, bucket_tokens=256, impl=impl, pages_per_block=pages_per_block,
                      queries_per_block=queries_per_block, tiles_per_group=tiles_per_group)
    for (s, a, b), o in zip(second, outs):
        np.testing.assert_allclose(o, batch.dense(s, a, b), atol=1e-5, rtol=0)


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_cpu_kernel_ragged_batch_matches_dense(page_size):
    """The kernel ignores the reference's block sizes; page sizes and chunk shapes are what vary."""
    test_ragged_batch_matches_dense(page_size, (8, 16, 8), impl="cpu_kernel")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("window", [None, 20, 40])
def test_decoding_rows_on_pages_of_several_key_blocks(impl, window):
    """Single-token rows (the CPU kernel's all-heads path) on pages of 64 keys, four blocks of 16: each block's
    causal and window mask is its own (a window of 20 or 40 starts inside a page and ends a block early)."""
    batch = PagedBatch(np.random.default_rng(11), [150, 90, 33], page_size=64, num_pages=12, pages_per_seq=3)
    prompts = [(0, 0, 149), (1, 0, 89), (2, 0, 32)]
    batch.step(prompts, 4, 320, impl=impl, sliding_window=window, pages_per_block=1, queries_per_block=8)
    chunks = [(0, 149, 150), (1, 89, 90), (2, 32, 33)]
    for (s, a, b), o in zip(chunks, batch.step(chunks, 4, 8, impl=impl, sliding_window=window, pages_per_block=1,
                                                queries_per_block=8)):
        np.testing.assert_allclose(o, batch.dense(s, a, b, window), atol=1e-5, rtol=0)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("window, soft_cap", [(None, None), (9, 20.0)])
def test_a_query_row_has_the_same_bits_in_every_kind_of_step(impl, window, soft_cap):
    """A token's attention output, bit for bit, whether it is a decoding sequence's one new token, the last
    of a prompt chunk, inside a whole prompt, or beside other sequences: a token's KV recomputed after a
    preemption, or a suffix computed after cached pages, is then the KV its first step wrote."""
    def last_row(steps):
        batch = PagedBatch(np.random.default_rng(3), [37, 20, 50], page_size=4, num_pages=40, pages_per_seq=13)
        for chunks in steps:
            outs = batch.step(chunks, max_seqs=4, bucket_tokens=128, impl=impl, sliding_window=window,
                              soft_cap=soft_cap)
        return np.asarray(outs[0][-1])

    ways = {"decoding": [[(0, 0, 36)], [(0, 36, 37)]],
            "decoding beside a prompt": [[(0, 0, 36)], [(0, 36, 37), (1, 0, 20)]],
            "decoding beside decodes": [[(0, 0, 36), (2, 0, 40)], [(0, 36, 37), (2, 40, 41)]],
            "end of a chunk": [[(0, 0, 27)], [(0, 27, 37)]],
            "end of a prompt": [[(0, 0, 37)]],
            "chunk beside another": [[(0, 0, 30)], [(0, 30, 37), (2, 0, 50)]]}
    rows = {name: last_row(steps) for name, steps in ways.items()}
    for name, row in rows.items():
        assert np.array_equal(row, rows["decoding"]), f"{impl}: {name} differs from decoding"


@pytest.mark.parametrize("impl", IMPLS)
def test_prompt_in_many_chunks_and_single_tokens(impl):
    rng = np.random.default_rng(7)
    batch = PagedBatch(rng, [100, 37], page_size=4, num_pages=64, pages_per_seq=25)
    bounds = [0, 13, 14, 50, 51, 52, 99, 100]
    for a, b in zip(bounds[:-1], bounds[1:]):
        chunks = [(0, a, b)] + ([(1, a, min(b, 37))] if a < 37 else [])
        outs = batch.step(chunks, max_seqs=4, bucket_tokens=64, impl=impl, pages_per_block=2, queries_per_block=4)
        for (s, x, y), o in zip(chunks, outs):
            np.testing.assert_allclose(o, batch.dense(s, x, y), atol=1e-5, rtol=0)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("window", [1, 5, 16])
def test_sliding_window(window, impl):
    rng = np.random.default_rng(window)
    batch = PagedBatch(rng, [70, 9, 31], page_size=4, num_pages=40, pages_per_seq=18)
    chunks = [(0, 0, 30), (1, 0, 9), (2, 0, 31)]
    for (s, a, b), o in zip(chunks, batch.step(chunks, 4, 96, impl=impl, sliding_window=window, pages_per_block=2,
                                                queries_per_block=8)):
        np.testing.assert_allclose(o, batch.dense(s, a, b, window), atol=1e-5, rtol=0)
    chunks = [(0, 30, 70)]
    for (s, a, b), o in zip(chunks, batch.step(chunks, 4, 64, impl=impl, sliding_window=window, pages_per_block=2,
                                                queries_per_block=8)):
        np.testing.assert_allclose(o, batch.dense(s, a, b, window), atol=1e-5, rtol=0)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("window", [None, 5])
def test_soft_capped_scores(window, impl):
    """Gemma 2's attention logit soft-capping (C * tanh(s / C), before the mask), with and without a window,
    prompt chunks and single tokens: a cap of 0.7 bends most scores (they are about N(0, 1) here)."""
    rng = np.random.default_rng(21)
    batch = PagedBatch(rng, [70, 9, 31], page_size=4, num_pages=40, pages_per_seq=18)
    for chunks, bucket in (([(0, 0, 30), (1, 0, 8), (2, 0, 31)], 96), ([(0, 30, 69), (1, 8, 9)], 64),
                           ([(0, 69, 70)], 8)):
        outs = batch.step(chunks, 4, bucket, impl=impl, sliding_window=window, soft_cap=0.7, pages_per_block=2,
                          queries_per_block=8)
        for (s, a, b), o in zip(chunks, outs):
            np.testing.assert_allclose(o, batch.dense(s, a, b, window, soft_cap=0.7), atol=1e-5, rtol=0)
            assert np.abs(o - batch.dense(s, a, b, window)).max() > 1e-3  # the cap really changed the result


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("impl,group", [("reference", 1), ("reference", 3), ("reference", 64), ("cpu_kernel", 1)])
def test_tile_result_does_not_depend_on_the_other_tiles(impl, group, window):
    """Tiles are sorted by how many KV blocks they need and walked in groups (the kernel hands out work
    items biggest first): a sequence's output must be bit-identical whatever else is in the step (other
    sequences, their order), as samples rely on."""
    seq_lens = [1, 90, 3, 47, 16, 64, 2, 33]
    chunks = [(0, 0, 1), (1, 40, 90), (2, 2, 3), (3, 0, 47), (4, 15, 16), (5, 20, 64), (6, 1, 2), (7, 0, 33)]
    subsets = [chunks, chunks[::-1], [chunks[1], chunks[4]], [chunks[4], chunks[7], chunks[0]]]
    results = {}
    for subset in subsets:
        batch = PagedBatch(np.random.default_rng(3), seq_lens, page_size=4, num_pages=80, pages_per_seq=23)
        batch.step([(s, 0, a) for s, a, _ in chunks if a > 0], max_seqs=8, bucket_tokens=128, impl=impl,
                   pages_per_block=2, queries_per_block=4, tiles_per_group=group, sliding_window=window)
        outs = batch.step(subset, max_seqs=8, bucket_tokens=256, impl=impl, pages_per_block=2, queries_per_block=4,
                          tiles_per_group=group, sliding_window=window)
        for chunk, o in zip(subset, outs):
            np.testing.assert_allclose(o, batch.dense(*chunk, window), atol=1e-5, rtol=0)
            if chunk in results:
                np.testing.assert_array_equal(o, results[chunk], err_msg=f"sequence {chunk[0]}")
            results[chunk] = o


def test_write_kv_drops_padding_slots():
    pool = jnp.zeros((3, 2, 4, 2))
    k = jnp.ones((3, 2, 2))
    v = 2 * jnp.ones((3, 2, 2))
    out = np.asarray(write_kv(pool, k, v, jnp.array([5, 0, 6], jnp.int32)))  # slot 6 = 3 pages * 2: padding
    assert np.all(out[2, 1, 0::2] == 1) and np.all(out[2, 1, 1::2] == 2)  # slot 5 = page 2, offset 1
    assert np.all(out[0, 0, 0::2] == 1)
    assert np.count_nonzero(out) == 2 * 2 * 4


def test_auto_picks_the_cpu_kernel_for_float32_and_the_reference_otherwise():
    assert resolve_attention_impl("auto", jnp.float32) == "cpu_kernel"
    assert resolve_attention_impl("auto", jnp.bfloat16) == "reference"
    assert resolve_attention_impl("reference", jnp.float32) == "reference"
    with pytest.raises(ValueError, match="takes float32.*bfloat16"):
        resolve_attention_impl("cpu_kernel", jnp.bfloat16)


def test_cpu_kernel_build_failure_names_the_compiler(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with pytest.raises(cpu_attention.KernelUnavailable, match="no C\\+\\+ compiler .*no-such-compiler.*set CXX"):
        cpu_attention.build()


@pytest.mark.parametrize("window,soft_cap", [(None, None), (7, 0.7)])
def test_cpu_kernel_row_is_bit_identical_in_a_long_chunk_and_alone(window, soft_cap):
    """A query row gives the same bits whether its work item holds many rows (vector lanes) or one token
    (the all-heads path): how a prompt is cut into chunks must not change the rounding, with a window and
    soft-capped scores too."""
    rng = np.random.default_rng(11)
    pool = jnp.asarray(rng.standard_normal((16, 4, 2 * NUM_KV_HEADS, HEAD_DIM)).astype(np.float32))
    q = rng.standard_normal((40, NUM_HEADS, HEAD_DIM)).astype(np.float32)
    pages = jnp.asarray(rng.permutation(16)[:10].reshape(1, 10).astype(np.int32))

    def attend(q_rows, start):
        n = len(q_rows)
        return np.asarray(ragged_paged_attention(
            jnp.asarray(q_rows), pool, jnp.array([start + n]), pages, jnp.array([0, n]), jnp.array([1]),
            sm_scale=SCALE, sliding_window=window, soft_cap=soft_cap, impl="cpu_kernel", pages_per_block=8,
            queries_per_block=16))

    whole = attend(q, 0)
    for t in (0, 17, 39):
        np.testing.assert_array_equal(attend(q[t:t + 1], t)[0], whole[t])


@pytest.mark.parametrize("head_dim,kv_heads,group,page_size", [(64, 4, 2, 16), (128, 2, 1, 16), (72, 2, 3, 4),
                                                               (8, 1, 4, 32), (272, 1, 2, 4), (20, 2, 2, 16)])
def test_cpu_kernel_score_order_is_the_same_in_both_paths_at_real_head_dims(head_dim, kv_heads, group, page_size):
    """The kernel's two paths sum a score in one fixed order (16 partial sums, then a tree) whatever the head
    size: the compiled sizes (64, 128), one that ends in a partial block of 16 (72), one wider than the
    registers hold (272), one that is no whole number of 8-column blocks either (20), and pages longer than 16
    keys. A row alone (the all-heads path, keys in lanes) equals the same row in a 16-token chunk (rows in
    lanes), bit for bit, and both match dense attention."""
    rng = np.random.default_rng(head_dim + group)
    heads, num_pages, ctx = kv_heads * group, 24, 70
    pool = rng.standard_normal((num_pages, page_size, 2 * kv_heads, head_dim)).astype(np.float32)
    q = rng.standard_normal((ctx, heads, head_dim)).astype(np.float32)
    pages = rng.permutation(num_pages)[:math.ceil(ctx / page_size)].reshape(1, -1).astype(np.int32)
    scale = head_dim**-0.5

    def attend(q_rows, start):
        n = len(q_rows)
        return np.asarray(ragged_paged_attention(
            jnp.asarray(q_rows), jnp.asarray(pool), jnp.array([start + n]), jnp.asarray(pages), jnp.array([0, n]),
            jnp.array([1]), sm_scale=scale, sliding_window=None, impl="cpu_kernel", pages_per_block=8,
            queries_per_block=16))

    slots = pool[pages[0]].reshape(-1, 2 * kv_heads, head_dim)[:ctx]
    k, v = np.repeat(slots[:, 0::2], group, axis=1), np.repeat(slots[:, 1::2], group, axis=1)
    chunk = attend(q[48:64], 48)
    for t in (48, 55, 63):
        alone = attend(q[t:t + 1], t)[0]
        np.testing.assert_array_equal(alone, chunk[t - 48], err_msg=f"row {t}")
        s = np.einsum("hd,khd->hk", q[t], k[:t + 1]) * scale
        p = np.exp(s - s.max(-1, keepdims=True))
        np.testing.assert_allclose(alone, np.einsum("hk,khd->hd", p / p.sum(-1, keepdims=True), v[:t + 1]),
                                   atol=1e-5, rtol=0)


@pytest.mark.parametrize("rows, heads, head_dim", [(1, 2, 16), (37, 8, 64), (64, 8, 128)])
def test_cpu_rope_is_torchs_rotation_bit_for_bit(rows, heads, head_dim):
    """The native RoPE (used with the CPU kernel) rounds each product before the sum, as transformers' CPU torch does
    (`q * cos + rotate_half(q) * sin`): the same bits for any number of rows."""
    import torch
    from transformers.models.llama.modeling_llama import rotate_half

    rng = np.random.default_rng(rows)
    x = rng.standard_normal((rows, heads, head_dim)).astype(np.float32) * 3
    angles = rng.uniform(0, 1000, (rows, head_dim // 2)).astype(np.float32)
    cos = np.cos(np.concatenate([angles, angles], -1)).astype(np.float32)
    sin = np.sin(np.concatenate([angles, angles], -1)).astype(np.float32)
    xt, ct, st = torch.from_numpy(x), torch.from_numpy(cos)[:, None], torch.from_numpy(sin)[:, None]
    expected = (xt * ct + rotate_half(xt) * st).numpy()
    assert (np.asarray(cpu_attention.rope(jnp.asarray(x), jnp.asarray(cos), jnp.asarray(sin))) == expected).all()


@pytest.mark.parametrize("head_dim,kv_heads,group,page_size,soft_cap", [
    (64, 4, 2, 16, None), (128, 2, 8, 16, None), (72, 1, 4, 8, 0.9), (8, 2, 3, 4, None)])
def test_cpu_kernel_decoding_rows_that_share_pages_get_their_bits_alone(head_dim, kv_heads, group, page_size, soft_cap):
    """Decoding sequences whose first pages are the same physical pages (a prefix cache hit) walk those pages
    together, rows of several sequences in vector lanes, then their own pages from the softmax state that walk
    left: each row gets the bits it gets with the pages walked alone (`share_pages=False`) and with the shared
    pages copied to pages of its own, and matches dense attention. The step also holds a sequence that shares
    fewer pages, one that shares none, and a prompt chunk on the shared pages (neither joins a group); with
    group >= 8 a decoding row's own item puts its rows in lanes too."""
    rng = np.random.default_rng(head_dim + group)
    heads, shared = kv_heads * group, 5  # pages every member but the last shares; the last shares 3
    members = max(2, -(-8 // group)) + 1
    # sequences: the members, one with a copy of the shared pages, and a prompt chunk of 5 tokens on them
    lens = [shared * page_size + int(n) for n in rng.integers(2, 3 * page_size, members + 1)]
    lens.append(shared * page_size + 2 * page_size - 3)
    q_lens = [1] * (members + 1) + [5]
    nxt = shared
    lists = []

    def fresh(n):
        nonlocal nxt
        nxt += n
        return list(range(nxt - n, nxt))

    for s, ctx in enumerate(lens):
        first = list(range(shared)) if s < members - 1 or s == members + 1 else list(range(3)) + fresh(2)
        lists.append(fresh(shared) if s == members else first)
        lists[-1] += fresh(-(-ctx // page_size) - shared)
    copies = [fresh(shared) for _ in range(members)]  # each member's shared pages, copied to pages of its own
    pool = rng.standard_normal((nxt, page_size, 2 * kv_heads, head_dim)).astype(np.float32)
    pool[lists[members][:shared]] = pool[:shared]
    width = max(map(len, lists))
    pages = np.array([p + [0] * (width - len(p)) for p in lists], np.int32)
    copied_pages = pages.copy()
    for s, c in enumerate(copies):
        k = shared if s < members - 1 else 3
        pool[c[:k]] = pool[pages[s, :k]]
        copied_pages[s, :k] = c[:k]
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = rng.standard_normal((cu[-1], heads, head_dim)).astype(np.float32)
    scale = head_dim**-0.5

    def attend(page_table, share):
        return np.asarray(cpu_attention.ragged_paged_attention(
            jnp.asarray(q), jnp.asarray(pool), jnp.asarray(lens, jnp.int32), jnp.asarray(page_table), jnp.asarray(cu),
            jnp.array([len(lens)], jnp.int32), sm_scale=scale, sliding_window=None, soft_cap=soft_cap,
            share_pages=share))

    together, alone, copied = attend(pages, True), attend(pages, False), attend(copied_pages, True)
    np.testing.assert_array_equal(together, alone)
    np.testing.assert_array_equal(together, copied)
    for s, ctx in enumerate(lens):
        slots = pool[pages[s]].reshape(-1, 2 * kv_heads, head_dim)[:ctx]
        k, v = np.repeat(slots[:, 0::2], group, axis=1), np.repeat(slots[:, 1::2], group, axis=1)
        for t in range(q_lens[s]):
            pos = ctx - q_lens[s] + t
            sc = np.einsum("hd,khd->hk", q[cu[s] + t].astype(np.float64), k[:pos + 1]) * scale
            if soft_cap is not None:
                sc = soft_cap * np.tanh(sc / soft_cap)
            pr = np.exp(sc - sc.max(-1, keepdims=True))
            np.testing.assert_allclose(together[cu[s] + t], np.einsum("hk,khd->hd", pr / pr.sum(-1, keepdims=True),
                                                                      v[:pos + 1]), atol=1e-5, rtol=0)
