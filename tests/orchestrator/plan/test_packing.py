import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.config import EngineConfig, SamplingConfig
from engine import KVGroups, pages_needed
from orchestrator.plan import packing as packing_module
from orchestrator.plan.packing import (PackingConfig, PackingLimits, leading_page_keys, leading_page_keys_of_many,
                                       lower_bound, pack, shareable_prompt_tokens)


def limits(page_size=16, max_pages=256, max_seqs=16, in_prefill=4, prefill=256, steps=4, n=1, new=32):
    return PackingLimits.resolve(
        PackingConfig(max_prefill_steps=steps),
        EngineConfig(page_size=page_size, max_pages=max_pages, max_seqs=max_seqs, max_seqs_in_prefill=in_prefill,
                     max_prefill_size=prefill),
        SamplingConfig(n=n, max_new_tokens=new),
    )


@given(L=st.integers(1, 5000), n=st.integers(1, 8), M=st.integers(1, 600), ps=st.sampled_from([1, 2, 16, 64]))
def test_page_need_matches_formula(L, n, M, ps):
    lim = limits(page_size=ps, max_seqs=8, in_prefill=1, n=n, new=M)
    expected = L // ps + n * (math.ceil((L + M) / ps) - L // ps)
    assert lim.page_need(L) == expected
    assert lim.page_need(np.array([L]))[0] == expected
    # Never more than n private copies, never less than one sequence's worth.
    assert math.ceil((L + M) / ps) <= expected <= n * math.ceil((L + M) / ps)


def fitting(lengths, lim):
    return [x for x in lengths if lim.why_unfit(x) is None]


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 700), max_size=300), n=st.integers(1, 4),
       max_pages=st.integers(40, 400), max_seqs=st.integers(4, 32), steps=st.integers(1, 8))
def test_every_item_once_and_budgets_hold(lengths, n, max_pages, max_seqs, steps):
    lim = limits(max_pages=max_pages, max_seqs=max_seqs, in_prefill=min(4, max_seqs), steps=steps, n=n)
    tokens = np.array(fitting(lengths, lim), dtype=np.int64)
    p = pack(tokens, lim)
    assert sorted(p.order.tolist()) == list(range(len(tokens)))
    for b in range(p.num_batches):
        items = p.batch(b)
        assert len(items) >= 1
        assert int(lim.page_need(tokens[items]).sum()) == p.num_pages[b] <= lim.max_pages
        assert int(tokens[items].sum()) == p.num_prompt_tokens[b] <= lim.max_prompt_tokens
        assert len(items) * n <= lim.max_seqs and len(items) <= lim.max_prompts
        # longest first inside a batch, ties in corpus order
        keys = [(-tokens[i], i) for i in items]
        assert keys == sorted(keys)
    assert p.num_batches >= lower_bound(tokens, lim)
    again = pack(tokens.copy(), lim)
    assert np.array_equal(again.order, p.order) and np.array_equal(again.offsets, p.offsets)
    assert np.array_equal(p.batch_of_item()[p.order], np.repeat(np.arange(p.num_batches), np.diff(p.offsets)))


@pytest.mark.parametrize("distribution", ["lognormal", "uniform"])
@pytest.mark.parametrize("engine, sampling", [
    (EngineConfig(), SamplingConfig()),
    (EngineConfig(max_pages=4096, max_seqs=64), SamplingConfig(n=4, max_new_tokens=64)),
    (EngineConfig(max_pages=2048, max_seqs=256, max_seqs_in_prefill=32, max_prefill_size=2048), SamplingConfig(max_new_tokens=128)),
])
def test_efficiency_within_three_percent_of_lower_bound(distribution, engine, sampling):
    rng = np.random.default_rng(0)
    if distribution == "lognormal":
        tokens = np.clip(rng.lognormal(5.0, 1.0, 50_000), 1, 3000).astype(np.int64)
    else:
        tokens = rng.integers(1, 2000, 50_000)
    lim = PackingLimits.resolve(PackingConfig(), engine, sampling)
    tokens = tokens[[lim.why_unfit(int(x)) is None for x in tokens]]
    p = pack(tokens, lim)
    assert p.num_batches <= 1.03 * lower_bound(tokens, lim)


def test_unfit_item_is_an_error_and_n_above_max_seqs_is_refused():
    lim = limits(max_pages=10)
    assert "page_budget" in lim.why_unfit(500)
    with pytest.raises(ValueError, match="cannot fit"):
        pack(np.array([5, 500]), lim)
    with pytest.raises(ValueError, match="engine.max_seqs"):
        limits(max_seqs=4, in_prefill=2, n=5)
    assert pack(np.zeros(0, dtype=np.int64), lim).num_batches == 0


def test_leading_page_keys_name_the_prefix_up_to_each_full_page_before_the_last_token():
    rng = np.random.default_rng(0)
    block = rng.integers(0, 50000, 40)
    a = leading_page_keys(np.concatenate([block, [1, 2, 3]]), 16)
    b = leading_page_keys(np.concatenate([block, [9] * 30]), 16)
    assert len(a) == 2 and len(b) == 4  # (43 - 1) // 16 and (70 - 1) // 16 full pages before the last token
    assert list(a) == list(b[:2])  # the same 32 leading tokens, the same keys
    c = leading_page_keys(np.concatenate([block[:20], [7], block[21:], [1]]), 16)
    assert c[0] == a[0] and c[1] != a[1]  # a prefix key covers every token before it, not its page alone
    assert len(leading_page_keys(np.arange(16), 16)) == 0  # one page whose last token must be computed
    assert shareable_prompt_tokens([a, b, c], 16) == 16 * (8 - 5)  # a[0] twice more, a[1] once more


def test_page_keys_of_a_shard_at_once_are_each_prompts_polynomial_hash():
    """The whole-shard form (one numpy pass over every prompt) gives each prompt the keys of the hash written out:
    prefix of k tokens -> sum (t_j + 1) * B^(k-1-j) modulo 2**64 (0 becomes 1), at every full page before the
    last token, for empty, one-token, page-aligned and long prompts at several page sizes."""
    rng = np.random.default_rng(3)
    base = int(packing_module._KEY_BASE)
    for page_size in (1, 4, 16):
        prompts = [rng.integers(0, 150_000, n) for n in (0, 1, page_size, page_size + 1, 2 * page_size, 3, 97, 300)]
        offsets = np.concatenate([[0], np.cumsum([len(p) for p in prompts])])
        keys, key_offsets = leading_page_keys_of_many(np.concatenate(prompts), offsets, page_size)
        for i, p in enumerate(prompts):
            expected, prefix = [], 0
            for k, t in enumerate(p[:-1] if len(p) else (), 1):
                prefix = (prefix * base + int(t) + 1) % 2**64
                if k % page_size == 0:
                    expected.append(prefix or 1)
            assert keys[key_offsets[i]:key_offsets[i + 1]].tolist() == expected, (page_size, len(p))
            assert leading_page_keys(p, page_size).tolist() == expected


def test_prompts_sharing_a_leading_page_pack_together_and_are_counted_as_shareable():
    """Prompts behind one shared block land next to each other in the order (at the place of their longest),
    batches stay sized without credit for sharing, and without any shared page the order is the length order."""
    rng = np.random.default_rng(1)
    block = rng.integers(2, 8000, 64)
    prompts = []
    for i in range(40):
        tail = rng.integers(2, 8000, int(rng.integers(1, 200)))
        prompts.append(np.concatenate([block, tail]) if i % 4 == 0 else tail)
    tokens = np.array([len(p) for p in prompts], dtype=np.int64)
    keys = [leading_page_keys(p, 16) for p in prompts]
    first = np.array([k[0] if len(k) else 0 for k in keys], dtype=np.uint64)
    lim = limits(max_pages=120, max_seqs=8)
    plain, shared = pack(tokens, lim), pack(tokens, lim, first)
    shared_items = [i for i in range(40) if i % 4 == 0]
    def batches_of_shared(p):
        return sorted(set(p.batch_of_item()[shared_items].tolist()))

    together, apart = batches_of_shared(shared), batches_of_shared(plain)
    assert together == list(range(together[0], together[0] + len(together)))  # consecutive batches
    assert len(together) < len(apart)  # the length order alone spreads them over more batches
    assert sorted(shared.order.tolist()) == list(range(40))
    assert (shared.num_pages <= lim.max_pages).all()
    for b in range(shared.num_batches):  # each batch's pages counted in full, as if nothing were shared
        assert shared.num_pages[b] == int(lim.page_need(tokens[shared.batch(b)]).sum())
    assert np.array_equal(pack(tokens, lim, np.zeros(40, dtype=np.uint64)).order, plain.order)
    unique = np.arange(1, 41, dtype=np.uint64)
    assert np.array_equal(pack(tokens, lim, unique).order, plain.order)
    unique[::3] = 0  # some prompts without a full page, the rest each its own key
    assert np.array_equal(pack(tokens, lim, unique).order, plain.order)
    assert shareable_prompt_tokens(keys, 16) == 16 * 4 * (len(shared_items) - 1)  # 4 pages of the block, 9 repeats
    assert np.array_equal(pack(tokens, lim, first).order, shared.order)  # deterministic


def test_each_prompt_s_own_max_new_tokens_counts_its_pages():
    """Rows' `sampling.max_new_tokens` (per-row settings): a batch's pages are counted with each prompt's own
    completion length (the one formula, engine.pages_needed), and a prompt that cannot fit with its own is named."""
    limits = PackingLimits.resolve(PackingConfig(), EngineConfig(page_size=16, max_pages=64, max_seqs=8),
                                   SamplingConfig(max_new_tokens=16, n=1))
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 200, 60)
    own = rng.choice([1, 16, 300], 60)
    packing = pack(lengths, limits, max_new_tokens=own)
    seen = []
    for b in range(packing.num_batches):
        items = packing.batch(b)
        pages = sum(int(pages_needed(int(lengths[i]), int(own[i]), 16)) for i in items)
        assert pages == packing.num_pages[b] <= 64
        seen += items.tolist()
    assert sorted(seen) == list(range(60))
    assert packing.num_batches != pack(lengths, limits).num_batches  # the run's 16 everywhere packs otherwise
    assert lower_bound(lengths, limits, own) <= packing.num_batches
    with pytest.raises(ValueError, match="item 1 cannot fit any batch: it needs 126 KV pages .* of 2000 new tokens"):
        pack(np.array([5, 10, 3]), limits, max_new_tokens=np.array([1, 2000, 1]))


def test_a_scored_row_counts_its_continuations_pages_and_prefill():
    """A scored row (a context of 10 tokens, 3 continuations of at most 5): its continuations share the context's
    full pages before its last token and each holds the rest with its one drawn token; it takes 3 sequences and
    prefills its context once and every continuation."""
    limits = PackingLimits(page_size=4, max_new_tokens=16, n=1, max_pages=1000, max_prompt_tokens=1000, max_seqs=8,
                           max_prompts=8)
    assert limits.page_need(10, 6, 3) == (10 - 1) // 4 + 3 * (-(-(10 + 6) // 4) - (10 - 1) // 4)
    assert limits.page_need(np.array([10, 10]), np.array([6, 16]), np.array([3, 0])).tolist() == [8, 7]
    packing = pack(np.array([10, 10, 10, 12]), limits, max_new_tokens=np.array([6, 6, 6, 16]),
                   continuations=np.array([3, 3, 3, 0]), prefill_tokens=np.array([22, 22, 22, 12]))
    assert [len(packing.batch(b)) for b in range(packing.num_batches)] == [3, 1]  # 3 + 3 + 1 sequences, then 3
    assert sorted(packing.num_prompt_tokens.tolist()) == [22, 56]
    assert "9 continuations" in limits.why_unfit(10, 6, 9, 40) and limits.why_unfit(10, 6, 3, 22) is None


def test_sliding_window_layers_count_their_window_s_pages():
    """A model of two sliding layers (a window of 24) and one full layer, pages of 4 tokens, steps of up to 32 tokens:
    a 300-token prompt with 40 new tokens needs 85 pages in the full layer and at most 15 in each sliding one (its
    window and a step span 55 tokens: 14 pages, and the partial one), 39 pages' worth of every layer instead of 85;
    a prompt shorter than the window needs what one table needs. A model without a window is counted as before."""
    gemma = KVGroups.of([24, 24, None])
    assert pages_needed(300, 40, 4, groups=gemma, step_tokens=32) == -(-(85 + 15 + 15) // 3) == 39
    assert pages_needed(10, 4, 4, n=3, groups=gemma, step_tokens=32) == pages_needed(10, 4, 4, n=3)
    assert pages_needed(300, 40, 4, groups=KVGroups.single(3), step_tokens=32) == pages_needed(300, 40, 4) == 85
    engine = EngineConfig(page_size=4, max_pages=200, max_prefill_size=32, max_seqs=32)
    sampling = SamplingConfig(max_new_tokens=40)
    packing = PackingConfig(prefill_budget=4096)  # pages bind, not prefill
    grouped = PackingLimits.resolve(packing, engine, sampling, gemma)
    one_table = PackingLimits.resolve(packing, engine, sampling)
    assert grouped.step_tokens == 32 and grouped.page_need(300) == 39 and one_table.page_need(300) == 85
    lengths = np.full(12, 300)
    assert (pack(lengths, grouped).num_batches, pack(lengths, one_table).num_batches) == (3, 6)  # 5 and 2 a batch
