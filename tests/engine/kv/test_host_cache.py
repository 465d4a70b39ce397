"""The prefix cache's host tier (engine/kv/host_cache.py, engine/kv/swap.py) over the dummy runner of test_scheduler.py:
the dummy reads every token back from its fake KV pool and a page-in first empties the device page it fills, so
a spilled page lost, misplaced or paged into the wrong page changes the samples."""

from __future__ import annotations

import dataclasses

import numpy as np
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from engine import EngineConfig, Request, SamplingConfig
from engine.kv.host_cache import HostPrefixCache
from tests.engine.scheduling.test_scheduler import VOCAB, make_engine, reference

configs = st.builds(
    lambda ps, pages, seqs, prefill, k, pipe, host, mode: EngineConfig(
        page_size=ps, max_pages=max(pages, 64 // ps), max_seqs=seqs, max_seqs_in_prefill=min(2, seqs),
        max_prefill_size=prefill, decode_steps=k, pipeline_decode=pipe, max_seq_len=64, debug_invariants=True,
        host_kv_pages=host, preemption=mode, prefix_caching=True),
    st.sampled_from([2, 4, 8]), st.integers(8, 40), st.integers(1, 6), st.integers(1, 64), st.integers(1, 3),
    st.booleans(), st.sampled_from([1, 3, 8, 24, 200]), st.sampled_from(["recompute", "swap", "auto"]))

# (prefix, own length, new tokens, n, sampled): prompts built from a few shared prefixes
workloads = st.lists(st.tuples(st.integers(0, 3), st.integers(1, 12), st.integers(1, 20), st.integers(1, 3),
                               st.booleans()), min_size=1, max_size=8)


def _requests(workload, seed: int, call: int) -> list[Request]:
    rng = np.random.default_rng(seed)
    prefixes = [tuple(int(t) for t in rng.integers(1, VOCAB, length)) for length in (0, 7, 16, 29)]
    requests = []
    for i, (prefix, own, new, n, sampled) in enumerate(workload):
        prompt = (prefixes[prefix] + tuple(int(t) for t in rng.integers(1, VOCAB, own)))[:48]
        sampling = SamplingConfig(max_new_tokens=min(new, 64 - len(prompt)), temperature=1.0 if sampled else 0.0,
                                  seed=i, n=n)
        requests += [Request(f"c{call}p{i}", prompt, sampling, generation_index=g) for g in range(n)]
    return requests


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=configs, workloads=st.lists(workloads, min_size=1, max_size=3))
def test_the_host_tier_gives_the_samples_of_the_dummy_model_alone_and_keeps_its_invariants(config, workloads):
    """Calls one after another (the host tier outlives each), whatever the pools, preemption mode, chunking,
    forks and multi-step calls: every sample is its request's alone; after every step (debug_invariants) no
    page is both free and mapped, no host page has two owners (a swapped sequence, a host entry, a page-in of
    the step), the host pool is within engine.host_kv_pages and no cached page is in both tiers."""
    engine = make_engine(config)
    swapper = engine.scheduler.swapper
    moved = [0, 0]  # pages out and in, summed over the calls' stats (each call's stats start at 0)
    for call, workload in enumerate(workloads):
        requests = _requests(workload, len(workload) + call, call)
        got = {(c.prompt_id, c.generation_index): c.token_ids for c in engine.generate(requests)}
        for r in requests:
            assert got[(r.prompt_id, r.generation_index)] == reference(r, 64), r.prompt_id
        assert engine.scheduler.allocator.num_used == 0
        moved = [moved[0] + engine.stats.kv_pages_out, moved[1] + engine.stats.kv_pages_in]
        assert swapper.host.num_used == len(swapper.cache) <= config.host_kv_pages
    assert swapper.host.peak_used <= config.host_kv_pages
    assert swapper.pages_in <= swapper.pages_out
    assert moved == [swapper.pages_out, swapper.pages_in]
    event(f"paged in: {swapper.pages_in > 0}; swapped: {swapper.num_swaps > 0}")
    engine.reset()
    assert swapper.host.num_used == 0 and not swapper.cache


POOL = EngineConfig(page_size=4, max_pages=11, max_seqs=1, max_seqs_in_prefill=1, max_seq_len=44,
                    debug_invariants=True)
A = Request("a", tuple(range(1, 37)), SamplingConfig(max_new_tokens=8))
B = Request("b", tuple(range(2, 38)), SamplingConfig(max_new_tokens=8))


def test_a_prefix_the_device_reclaimed_is_paged_in_from_the_host_not_recomputed():
    """A device pool that holds one prompt: b reclaims a's 9 cached pages, which spill to the host; a sent again
    pages its first 8 back in (the 9th, holding its last token, is computed for its logits) and computes only
    its last 4 tokens, with the samples of a pool that never evicts."""
    engine = make_engine(dataclasses.replace(POOL, host_kv_pages=16), max_seq_len=44)
    first = engine.generate([A])[0].token_ids
    engine.generate([B])  # 44 tokens: 11 pages, so a's 9 cached pages are reclaimed and spilled
    s = engine.scheduler.swapper
    assert engine.scheduler.allocator.lookup((-1, tuple(range(1, 5)))) is None and len(s.cache) == 9
    assert s.pages_out == 9 and engine.stats.kv_pages_out == 9
    engine.stats.clear()
    assert engine.generate([A])[0].token_ids == first == reference(A, 44)
    assert engine.stats.prefix_cache_hit_tokens == 32 and engine.stats.kv_pages_in == 8
    assert engine.stats.recompute_avoided_tokens == 32
    assert sum(engine.stats.prefill_tokens) == 4  # only the last page's tokens


def test_the_host_tier_is_bounded_least_recently_used_first():
    """A host pool of 5 keeps a's first 5 spilled pages only (a page whose parent did not fit is unreachable), and
    a later spill replaces the least recently used entries."""
    engine = make_engine(dataclasses.replace(POOL, host_kv_pages=5), max_seq_len=44)
    first = engine.generate([A])[0].token_ids
    engine.generate([B])
    s = engine.scheduler.swapper
    assert len(s.cache) == 5 == s.host.num_used == s.host.peak_used
    engine.stats.clear()
    assert engine.generate([A])[0].token_ids == first  # b's pages spill now, evicting a's host entries
    assert engine.stats.kv_pages_in == 5 and engine.stats.prefix_cache_hit_tokens == 20
    assert s.host.peak_used == 5


def test_without_the_host_tier_an_evicted_prefix_is_recomputed():
    for config in (POOL, dataclasses.replace(POOL, host_kv_pages=16, prefix_caching=False)):
        engine = make_engine(config, max_seq_len=44)
        engine.generate([A])
        engine.generate([B])
        engine.stats.clear()
        assert engine.generate([A])[0].token_ids == reference(A, 44)
        assert engine.stats.kv_pages_in == engine.stats.kv_pages_out == 0 == len(engine.scheduler.swapper.cache)


def test_a_swap_out_takes_the_host_tier_pages_a_spill_never_takes_a_swapped_sequences():
    config = dataclasses.replace(POOL, host_kv_pages=9, preemption="swap", max_seqs=2, max_seqs_in_prefill=2,
                                 max_pages=20, max_seq_len=64)
    rng = np.random.default_rng(5)
    longs = [Request(f"g{i}", tuple(int(t) for t in rng.integers(1, VOCAB, 9)),
                     SamplingConfig(max_new_tokens=50, temperature=1.0, seed=i)) for i in range(4)]
    engine = make_engine(config)
    engine.generate([A])  # a's pages are cached on the device, then reclaimed and spilled by the long generations
    s = engine.scheduler.swapper
    for r in longs:
        engine.add_request(r)
    done, took = [], False
    while engine.has_unfinished:
        before = (s.num_swaps, len(s.cache), s.host.num_used)
        done += engine.step()
        if s.num_swaps > before[0] and before[2] == 9:  # a swap-out found the pool full of host entries
            took = took or len(s.cache) < before[1]
    assert took and s.num_fallbacks == 0 and s.host.peak_used <= 9
    got = {c.prompt_id: c.token_ids for c in done}
    assert [got[r.prompt_id] for r in longs] == [reference(r, 64) for r in longs]


def test_host_prefix_cache_evicts_a_subtree_and_drops_descendants_of_a_page_leaving_both_tiers():
    cache = HostPrefixCache()
    cache.add(1, -1, (1,), host_page=0)
    cache.add(2, 1, (2,), host_page=1)
    cache.add(3, 2, (3,), host_page=2)
    cache.add(7, 5, (9,), host_page=3)  # its parent (uid 5) is on the device
    assert cache.lookup(1, (2,)) == 2 and cache.lookup(5, (9,)) == 7
    cache.pin(1)  # being paged in: not evicted
    assert cache.evict_lru() == [1, 2]  # the least recently used unpinned entry is 2, and its child 3 goes with it
    cache.check()
    assert 2 not in cache and 3 not in cache and 1 in cache
    assert cache.drop_descendants(5) == [3] and 7 not in cache
    assert cache.evict_lru() is None  # 1 is pinned
    assert cache.take(1) == 0 and len(cache) == 0
    cache.check()
