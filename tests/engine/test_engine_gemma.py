"""The engine's bit-identity guarantees for Gemma 2 and Gemma 3 (tiny models written by transformers, a sliding
window of 24 tokens shorter than most sequences here, soft-capping), on the native CPU kernel and on the
reference attention: a sample's tokens and logprobs do not depend on its batch, on the prefix cache, or on
preemption by recompute or by swap. The same tests as tests/engine/test_engine.py and test_engine_swap.py run
for Llama; their request sets and drivers are reused."""

from __future__ import annotations

import numpy as np
import pytest

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
    for sampling in (SamplingConfig(max_new_tokens=8, temperature=0.0, seed=3),
                     SamplingConfig(max_new_tokens=8, temperature=0.8, top_p=0.9, seed=3)):
        requests = [Request(f"q{i}", tuple(p), sampling) for i, p in enumerate(prompts)]
        alone = Engine(gemma, EngineConfig(max_pages=64, max_seq_len=512, attention_impl=impl))
        reference = {r.prompt_id: c.token_ids for r in requests[:8] for c in alone.generate([r])}
        for config in (EngineConfig(max_pages=200, max_seqs=16, max_seq_len=512, attention_impl=impl),
                       EngineConfig(page_size=4, max_pages=300, max_seqs=3, max_seqs_in_prefill=2, max_prefill_size=64,
                                    max_seq_len=512, attention_impl=impl)):
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
    alone = Engine(gemma, EngineConfig(max_pages=64, max_seq_len=512))
    reference = {r.prompt_id: c.logprobs for r in requests[:4] for c in alone.generate([r])}
    got = {c.prompt_id: c.logprobs
           for c in Engine(gemma, EngineConfig(max_pages=200, max_seqs=16, max_seq_len=512)).generate(requests)}
    assert {pid: got[pid] for pid in reference} == reference


@pytest.mark.parametrize("impl", IMPLS)
def test_prefix_cache_and_recompute_preemption_keep_samples_bit_identical(gemma, impl):
    """Shared prefixes longer than the window, two calls of one engine: the cache on and off, and a pool that
    preempts (recompute), give the same tokens and logprobs as an ample pool without the cache."""
    requests = _shared_prefix_requests(2, 0.8)
    ample, _, none = _two_batches(gemma, impl, requests, max_pages=400, prefix_caching=False)
    cached, hits, _ = _two_batches(gemma, impl, requests, max_pages=400, prefix_caching=True)
    small, _, preempted = _two_batches(gemma, impl, requests, max_pages=24, prefix_caching=False)
    assert none == 0 and preempted > 0 and hits > 0
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
