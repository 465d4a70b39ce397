"""Swap preemption (engine/kv/swap.py) over the dummy runner of test_scheduler.py: the dummy reads every token
back from its fake KV pool, and a page-in first empties the device page it fills, so a page lost, misplaced or
recomputed in the host tier changes the samples or the count of KV entries written."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import EngineConfig, Request, SamplingConfig
from engine.kv.page_allocator import HostPageAllocator, PageAllocationError
from tests.engine.scheduling.test_scheduler import VOCAB, make_engine, reference

configs = st.builds(
    lambda ps, pages, seqs, prefill, k, pipe, host, mode, caching: EngineConfig(
        page_size=ps, max_pages=max(pages, 64 // ps), max_seqs=seqs, max_seqs_in_prefill=min(2, seqs),
        max_prefill_size=prefill, decode_steps=k, pipeline_decode=pipe, max_seq_len=64, debug_invariants=True,
        host_kv_pages=host, preemption=mode, prefix_caching=caching),
    st.sampled_from([2, 4, 8]), st.integers(8, 32), st.integers(2, 8), st.integers(1, 64), st.integers(1, 4),
    st.booleans(), st.sampled_from([1, 6, 24, 200]), st.sampled_from(["swap", "auto"]), st.booleans())


def _requests(workload, seed: int) -> list[Request]:
    rng = np.random.default_rng(seed)
    requests = []
    for i, (length, new, n, sampled) in enumerate(workload):
        prompt = tuple(int(t) for t in rng.integers(1, VOCAB, length))
        sampling = SamplingConfig(max_new_tokens=min(new, 64 - length), temperature=1.0 if sampled else 0.0,
                                  seed=i, n=n)
        requests += [Request(f"p{i}", prompt, sampling, generation_index=g) for g in range(n)]
    return requests


def _run(config: EngineConfig, requests: list[Request]):
    engine = make_engine(config)
    out = {(c.prompt_id, c.generation_index): c.token_ids for c in engine.generate(requests)}
    return engine, out


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=configs, workload=st.lists(st.tuples(st.integers(1, 30), st.integers(1, 30), st.integers(1, 3),
                                                   st.booleans()), min_size=1, max_size=8))
def test_swapped_samples_equal_the_dummy_model_alone_and_host_pages_balance(config, workload):
    """Whatever the pools, every sample is the one its request gives alone; the host pool never holds more
    than engine.host_kv_pages and is empty after the call; with n = 1 and no fallback to recompute, the KV
    entries written are exactly those of a pool that never preempts (nothing recomputed)."""
    requests = _requests(workload, len(workload))
    engine, got = _run(config, requests)
    for r in requests:
        assert got[(r.prompt_id, r.generation_index)] == reference(r, 64), r.prompt_id
    swapper = engine.scheduler.swapper
    assert swapper.host.num_used == len(swapper.cache) and swapper.host.peak_used <= config.host_kv_pages
    assert engine.scheduler.allocator.num_used == 0
    assert swapper.pages_in <= swapper.pages_out
    if config.preemption == "swap" and swapper.num_fallbacks == 0 and all(n == 1 for _, _, n, _ in workload):
        assert engine.runner.written == sum(len(r.prompt_token_ids) + len(got[(r.prompt_id, 0)]) - 1
                                            for r in requests)


def _long_generations(count: int = 6) -> list[Request]:
    rng = np.random.default_rng(3)
    return [Request(f"g{i}", tuple(int(t) for t in rng.integers(1, VOCAB, 9)),
                    SamplingConfig(max_new_tokens=50, temperature=1.0, seed=i)) for i in range(count)]


SMALL = EngineConfig(page_size=4, max_pages=20, max_seqs=4, max_seqs_in_prefill=4, max_prefill_size=16,
                     max_seq_len=64, decode_steps=2, prefix_caching=False, debug_invariants=True)


@pytest.mark.parametrize("pipeline", [True, False])
def test_swap_gives_the_samples_of_recompute_and_of_an_ample_pool_and_recomputes_nothing(pipeline):
    requests = _long_generations()
    small = dataclasses.replace(SMALL, pipeline_decode=pipeline)
    ample, expected = _run(dataclasses.replace(small, max_pages=200), requests)
    recompute, by_recompute = _run(small, requests)
    swap, by_swap = _run(dataclasses.replace(small, host_kv_pages=64, preemption="swap"), requests)
    assert by_swap == by_recompute == expected == {(r.prompt_id, 0): reference(r, 64) for r in requests}
    assert ample.scheduler.num_preemptions == 0 < recompute.scheduler.num_preemptions
    assert swap.scheduler.num_preemptions > 0 and swap.scheduler.swapper.num_fallbacks == 0
    s = swap.scheduler.swapper
    assert s.pages_out == s.pages_in > 0 and s.avoided_tokens > 0
    assert swap.runner.written == ample.runner.written < recompute.runner.written
    assert sum(swap.stats.prefill_tokens) == sum(ample.stats.prefill_tokens) < sum(recompute.stats.prefill_tokens)


def test_a_full_host_pool_falls_back_to_recompute_with_the_same_samples():
    requests = _long_generations()
    _, expected = _run(dataclasses.replace(SMALL, max_pages=200), requests)
    for host_pages in (1, 6):
        engine, got = _run(dataclasses.replace(SMALL, host_kv_pages=host_pages, preemption="swap"), requests)
        s = engine.scheduler.swapper
        assert got == expected
        assert s.num_fallbacks > 0 and s.host.peak_used <= host_pages
        assert (s.num_swaps > 0) == (host_pages == 6)


def test_auto_recomputes_what_the_prefix_cache_serves_and_swaps_the_rest():
    """`auto` recomputes a sequence with less than a page computed outside its cached prompt pages."""
    config = dataclasses.replace(SMALL, host_kv_pages=64, preemption="auto", prefix_caching=True, decode_steps=1,
                                 pipeline_decode=False)
    engine = make_engine(config)
    for i, prompt in enumerate([tuple(range(1, 10)), tuple(range(2, 11))]):  # 9 tokens: 2 full pages, then 1
        engine.add_request(Request(f"a{i}", prompt, SamplingConfig(max_new_tokens=30)))
    sched = engine.scheduler
    engine.step()  # both prompts computed, their full pages cached; one token drawn
    first, second = sched.running
    assert first.num_computed == 9 and first.num_cached_pages == 2
    sched._preempt(second)  # 1 token past its 8 cached ones: recompute
    assert second.swapped is None and second.num_computed == 0 and sched.swapper.num_swaps == 0
    for _ in range(4):
        engine.step()
    assert first.num_computed - 8 >= config.page_size
    sched._preempt(first)  # a page and more past its cached ones: swap
    assert first.swapped is not None and sched.swapper.num_swaps == 1
    while engine.has_unfinished:
        engine.step()
    assert sched.swapper.pages_in > 0
    requests = _long_generations()
    engine, got = _run(config, requests)
    assert engine.scheduler.swapper.num_swaps > 0 and got == {(r.prompt_id, 0): reference(r, 64) for r in requests}


def test_cached_prompt_pages_still_on_the_device_are_mapped_again_not_paged_in():
    """A preempted sequence's cached prompt pages stay findable: its page-in moves only the others."""
    config = dataclasses.replace(SMALL, prefix_caching=True, host_kv_pages=64, preemption="swap")
    rng = np.random.default_rng(4)
    prefix = tuple(int(t) for t in rng.integers(1, VOCAB, 16))  # 4 full pages, shared by every prompt
    requests = [Request(f"s{i}", prefix + (i + 1,), SamplingConfig(max_new_tokens=40, temperature=1.0, seed=i))
                for i in range(6)]
    engine, got = _run(config, requests)
    assert got == {(r.prompt_id, 0): reference(r, 64) for r in requests}
    s = engine.scheduler.swapper
    assert s.num_swaps > 0 and s.pages_in < s.pages_out  # the shared prefix's pages were found, not copied


def test_host_page_allocator_is_bounded_and_refuses_double_frees():
    host = HostPageAllocator(3)
    a = host.allocate(2)
    assert host.allocate(2) is None and host.num_used == 2  # nothing taken when it does not fit
    b = host.allocate(1)
    assert sorted(a + b) == [0, 1, 2] and host.peak_used == 3
    host.free(a)
    with pytest.raises(PageAllocationError, match="double free of host page"):
        host.free(a[:1])
    host.check([b])
    host.reset()
    assert host.num_used == 0 and host.allocate(3) is not None


def test_swap_without_a_host_pool_is_a_config_error():
    with pytest.raises(ValueError, match="engine.preemption=swap needs a host pool: set engine.host_kv_pages > 0"):
        EngineConfig(preemption="swap")
