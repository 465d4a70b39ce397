"""The engine's bit-identity guarantees for Gemma 2 and Gemma 3 (tiny models written by transformers, a sliding
window of 24 tokens shorter than most sequences here, soft-capping), on the native CPU kernel and on the
reference attention: a sample's tokens and logprobs do not depend on its batch, on the prefix cache, or on
preemption by recompute or by swap. The same tests as tests/engine/test_engine.py and test_engine_swap.py run
for Llama; their request sets and drivers are reused."""

from __future__ import annotations

import numpy as np
import pytest

from engine import pages_needed
from engine.config import EngineConfig, SamplingConfig
from engine.engine import Engine
from engine.scheduling.sequence import Request
from tests.engine.models.hf_reference import make_hf_model, varied_prompts
from tests.engine.test_engine import _shared_prefix_requests, _two_batches
from tests.engine.test_engine_swap import SMALL, _requests, _run

IMPLS = ["cpu_kernel", pytest.param("reference", marks=pytest.mark.slow)]


@pytest.fixture(scope="module", params=["gemma2", "gemma3_text"])
def gemma(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    make_hf_model(request.param, path, vocab=512)
    return path


@pytest.mark.parametrize("impl", IMPLS)
def test_sample_does_not_depend_on_its_batch(gemma, impl):
    """Prompts of 1 to 400 tokens, greedy and seeded: each alone, and shuffled in batches of other shapes and page
    sizes, draws the same tokens (as tests/engine/test_engine.py asserts for Llama)."""
    prompts = varied_prompts(512, count=16, seed=5)
    configs = (EngineConfig(max_pages=200, max_seqs=16, max_seq_len=512, attention_impl=impl),
               EngineConfig(page_size=4, max_pages=300, max_seqs=3, max_seqs_in_prefill=2, max_prefill_size=64,
                            max_seq_len=512, attention_impl=impl))
    alone = Engine(gemma, configs[0])  # alone in its steps, under the first batching's settings (its programs)
    for sampling in (SamplingConfig(max_new_tokens=8, temperature=0.0, seed=3),
                     SamplingConfig(max_new_tokens=8, temperature=0.8, top_p=0.9, seed=3)):
        requests = [Request(f"q{i}", tuple(p), sampling) for i, p in enumerate(prompts)]
        reference = {r.prompt_id: c.token_ids for r in requests[:8] for c in alone.generate([r])}
        for config in configs:
            shuffled = list(requests)
            np.random.default_rng(1).shuffle(shuffled)
            got = {c.prompt_id: c.token_ids for c in Engine(gemma, config).generate(shuffled)}
            for pid, tokens in reference.items():
                assert got[pid] == tokens, f"{pid} with {sampling} under {config}"


def test_logprobs_do_not_depend_on_the_batch_at_one_page_size(gemma):
    """The same page size, other batch compositions: the logprobs are the same bits alone and in a batch of 16. Gemma's
    soft-capped logits make greedy logprobs far from 0, so this sees the last bits of every layer (it once failed on
    the QK-norm's variance and on the embedding scale: tests/engine/models/test_row_bits.py)."""
    prompts = varied_prompts(512, count=16, seed=5)
    sampling = SamplingConfig(max_new_tokens=8, temperature=0.0, seed=3, logprobs=True)
    requests = [Request(f"q{i}", tuple(p), sampling) for i, p in enumerate(prompts)]
    config = EngineConfig(max_pages=200, max_seqs=16, max_seq_len=512)
    reference = {r.prompt_id: c.logprobs for r in requests[:4] for c in Engine(gemma, config).generate([r])}
    got = {c.prompt_id: c.logprobs for c in Engine(gemma, config).generate(requests)}
    assert {pid: got[pid] for pid in reference} == reference


@pytest.mark.parametrize("impl", IMPLS)
def test_prefix_cache_and_recompute_preemption_keep_samples_bit_identical(gemma, impl):
    """Shared prefixes longer than the window, two calls of one engine: the cache on and off, a pool that preempts
    (recompute), and one page table for every layer instead of the layer groups give the same tokens and logprobs
    as an ample pool without the cache."""
    requests = _shared_prefix_requests(2, 0.8)
    ample, _, none = _two_batches(gemma, impl, requests, max_pages=400, prefix_caching=False)
    one_table, _, _ = _two_batches(gemma, impl, requests, max_pages=400, prefix_caching=False, kv_groups="off")
    cached, hits, _ = _two_batches(gemma, impl, requests, max_pages=400, prefix_caching=True)
    small, _, preempted = _two_batches(gemma, impl, requests, max_pages=24, prefix_caching=False)
    assert none == 0 and preempted > 0 and hits > 0
    assert one_table == ample  # the layer groups (engine.kv_groups auto, the default) change no bit
    assert cached == ample
    assert small == ample


@pytest.mark.parametrize("impl", IMPLS)
def test_swap_recompute_and_an_ample_pool_give_bit_identical_samples(gemma, impl):
    requests = _requests(0.8, 2)
    model = (gemma, impl)  # what test_engine_swap's _run takes: (checkpoint, attention_impl)
    ample, _ = _run(model, requests, max_pages=200)
    recompute, recompute_engine = _run(model, requests, preemption="recompute", host_kv_pages=64, **SMALL)
    swap, swap_engine = _run(model, requests, preemption="swap", host_kv_pages=64, **SMALL)
    assert recompute_engine.scheduler.num_preemptions > 0 and swap_engine.stats.kv_pages_out > 0
    assert swap_engine.stats.recompute_tokens == 0
    assert swap == recompute == ample


def _stepped(engine: Engine, requests: list[Request], watch) -> dict:
    """Run `requests` step by step, calling `watch(engine)` after each step; the samples by prompt id."""
    for r in requests:
        assert engine.add_request(r) is None
    done = []
    while engine.has_unfinished:
        done += engine.step()
        watch(engine)
    return {c.prompt_id: (c.token_ids, c.logprobs) for c in done}


@pytest.mark.parametrize("family, full, sliding", [("gemma3_text", 1, 2), ("mistral", 0, 2)])
@pytest.mark.parametrize("decode_steps", [1, 4])
def test_sliding_layers_hold_only_their_window(family, full, sliding, decode_steps, tmp_path):
    """Gemma 3 with S = 2 sliding layers (a window of W = 24 tokens) and G = 1 full one, and Mistral with its window
    on both layers (G = 0): a sequence of L tokens holds at most (G + S W / L) / (G + S) of the KV pages one table
    for every layer would, plus a page per group (the allocator's own count of units in use, after every step of
    a 300-token prompt and 40 new tokens), and its tokens and logprobs are those of one table (kv_groups off)."""
    make_hf_model(family, tmp_path, vocab=512, **({"sliding_window": 24} if family == "mistral" else {}))
    prompt = np.random.default_rng(0).integers(6, 512, 300).tolist()
    request = Request("long", tuple(prompt), SamplingConfig(max_new_tokens=40, temperature=0.0, logprobs=True))
    ps, G, S, W = 4, full, sliding, 24
    seen = []

    def watch(engine):
        (seq,) = engine.scheduler.running or [None]
        if seq is not None:
            groups, used, L = engine.scheduler.kv.groups, engine.scheduler.kv.num_used, seq.num_computed
            one_table = seq.num_pages * groups.num_groups  # in units (k layers of one page): every group full
            seen.append((L, used, one_table))
            assert used <= (G + S * W / L) / (G + S) * one_table + groups.num_groups, (L, used, one_table)

    config = dict(page_size=ps, max_pages=200, max_seq_len=512, decode_steps=decode_steps, max_prefill_size=64,
                  debug_invariants=True, prefix_caching=False)
    grouped = _stepped(Engine(tmp_path, EngineConfig(**config)), [request], watch)
    # At 340 tokens: 85 pages in a full layer, at most 8 in a sliding one.
    assert seen and seen[-1][1] < (0.45 if G else 0.15) * seen[-1][2]
    one_table = _stepped(Engine(tmp_path, EngineConfig(kv_groups="off", **config)), [request], lambda e: None)
    assert grouped == one_table


def test_a_long_context_workload_runs_a_larger_batch_in_the_same_pool(tmp_path):
    """Eight prompts of 200 tokens and 40 new tokens in a pool of 180 pages (of every layer): one table holds three
    such sequences at once (61 pages each), the layer groups nearly three times as many (the two sliding layers
    hold 8 pages each, not 61); the samples are the same, and the grouped engine preempts less."""
    make_hf_model("gemma3_text", tmp_path, vocab=512)
    rng = np.random.default_rng(1)
    sampling = SamplingConfig(max_new_tokens=40, temperature=0.0, logprobs=True)
    requests = [Request(f"r{i}", tuple(rng.integers(6, 512, 200).tolist()), sampling) for i in range(8)]
    runs = {}
    for mode in ("off", "auto"):
        peak = [0]
        engine = Engine(tmp_path, EngineConfig(page_size=4, max_pages=180, max_seqs=8, max_seq_len=512, kv_groups=mode))
        samples = _stepped(engine, requests, lambda e: peak.__setitem__(0, max(peak[0], len(e.scheduler.running))))
        runs[mode] = samples, peak[0], engine.scheduler.num_preemptions
    (off, off_peak, off_preempted), (auto, auto_peak, auto_preempted) = runs["off"], runs["auto"]
    assert auto == off
    assert off_peak <= 3 and auto_peak >= 6, (off_peak, auto_peak)
    assert auto_preempted <= off_preempted


def test_a_batch_that_fits_by_the_grouped_count_runs_without_preemption(tmp_path):
    """What packing counts for a model with sliding layers (pages_needed with the engine's layer groups) is an upper
    bound on what the engine holds: twelve prompts of 100 to 300 tokens and 40 new tokens, in a pool of exactly
    their grouped need (about half what one table needs), run at once with none preempted, their prompts in
    chunks of up to 32 tokens and decode calls of 4 steps run ahead."""
    make_hf_model("gemma3_text", tmp_path, vocab=512)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(6, 512, int(n)).tolist() for n in rng.integers(100, 301, 12)]
    sampling = SamplingConfig(max_new_tokens=40, temperature=0.8, seed=1)
    probe = Engine(tmp_path, EngineConfig(max_pages=128, max_seq_len=512))
    groups = probe.scheduler.kv.groups
    assert groups.num_groups == 3
    ps, step_tokens = 4, max(32, 2 * 4)
    need = sum(pages_needed(len(p), 40, ps, groups=groups, step_tokens=step_tokens) for p in prompts)
    assert need < 0.55 * sum(pages_needed(len(p), 40, ps) for p in prompts)  # 362 of 711
    engine = Engine(tmp_path, EngineConfig(page_size=ps, max_pages=max(need, 128), max_seqs=16, max_seqs_in_prefill=12,
                                           max_prefill_size=32, max_seq_len=512, decode_steps=4, debug_invariants=True))
    out = engine.generate([Request(f"p{i}", tuple(p), sampling) for i, p in enumerate(prompts)])
    assert len(out) == 12 and engine.scheduler.num_preemptions == 0
