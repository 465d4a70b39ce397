import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.config import EngineConfig, SamplingConfig
from orchestrator.packing import PackingConfig, PackingLimits, lower_bound, pack


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
