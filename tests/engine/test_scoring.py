"""Scored rows (continuation log-likelihoods) and prompt logprobs: against transformers in float32, bit-identical
across batching, chunking, prefix caching and preemption, and the prompt of several continuations computed once."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.config import EngineConfig, SamplingConfig
from engine.engine import Engine
from engine.scheduling.sequence import Request
from tests.engine.models.hf_reference import make_hf_model

GREEDY = SamplingConfig(max_new_tokens=4, temperature=0.0)
CONTEXT = [int(t) for t in np.random.default_rng(1).integers(6, 256, 37)]
CONTINUATIONS = [[7, 9], [40, 41, 42, 43, 44], [200], [13, 14, 15]]


@pytest.fixture(scope="module", params=["llama3", "qwen2"])
def family_model(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param)
    return out, make_hf_model(request.param, out)


def _engine(path, **overrides) -> Engine:
    config = dict(page_size=4, max_pages=256, max_seqs=8, max_prefill_size=64, max_seq_len=256)
    return Engine(path, EngineConfig(**{**config, **overrides}))


def _scored(sampling: SamplingConfig = GREEDY) -> list[Request]:
    return [Request("q", tuple(CONTEXT + c), sampling, i, num_context_tokens=len(CONTEXT))
            for i, c in enumerate(CONTINUATIONS)]


def _hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits: row p scores token p + 1."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def test_continuation_and_prompt_logprobs_equal_transformers(family_model):
    path, model = family_model
    records = _engine(path).generate(_scored() + [
        Request("p", tuple(CONTEXT), SamplingConfig(max_new_tokens=3, prompt_logprobs=3, logprobs=True))])
    for record, continuation in zip(records, CONTINUATIONS):
        ids = CONTEXT + continuation
        ref = _hf_logprobs(model, ids)
        rows = torch.arange(len(CONTEXT) - 1, len(ids) - 1)
        want = ref[rows, torch.tensor(continuation)]
        assert record.error is None and record.completion == "" and record.finish_reason is None
        assert record.token_ids == continuation and record.num_prompt_tokens == len(CONTEXT)
        np.testing.assert_allclose(record.continuation_logprobs, want.numpy(), rtol=0, atol=1e-4)
        assert abs(record.continuation_logprob - float(want.sum())) < 1e-4
        assert record.is_greedy == bool((ref[rows].argmax(-1) == torch.tensor(continuation)).all())
        assert record.prompt_logprobs is None
    sampled = records[-1]
    ref = _hf_logprobs(model, CONTEXT)
    assert len(sampled.prompt_logprobs) == len(CONTEXT) - 1 and len(sampled.token_ids) == 3
    for p, entry in enumerate(sampled.prompt_logprobs):
        assert entry["token_id"] == CONTEXT[p + 1]
        assert abs(entry["logprob"] - float(ref[p, CONTEXT[p + 1]])) < 1e-4
        top = torch.topk(ref[p], 3)
        assert [t["token_id"] for t in entry["top"]] == top.indices.tolist()
        np.testing.assert_allclose([t["logprob"] for t in entry["top"]], top.values.numpy(), rtol=0, atol=1e-4)


def test_a_greedy_continuation_is_greedy(family_model):
    """The engine's own greedy completion, scored as a continuation: is_greedy, and its logprobs are the sampled
    tokens' logprobs within float rounding of the two programs."""
    path, _ = family_model
    engine = _engine(path)
    [sampled] = engine.generate([Request("g", tuple(CONTEXT), SamplingConfig(max_new_tokens=5, logprobs=True))])
    [scored] = engine.generate([Request("g", tuple(CONTEXT + sampled.token_ids), GREEDY,
                                        num_context_tokens=len(CONTEXT))])
    assert scored.is_greedy is True
    np.testing.assert_allclose(scored.continuation_logprobs, sampled.logprobs, rtol=0, atol=1e-5)


def test_scores_are_bit_identical_across_batching_chunking_caching_and_preemption(family_model):
    path, _ = family_model
    sampling = SamplingConfig(max_new_tokens=16, prompt_logprobs=2, temperature=0.7, logprobs=True)
    requests = ([Request(f"p{i}", tuple(CONTEXT[i:]), sampling) for i in range(2)] + _scored(sampling)
                + [Request(f"p{i}", tuple(CONTEXT[i:]), sampling) for i in range(2, 4)])
    alone = [_engine(path, prefix_caching=False).generate([r])[0] for r in requests]
    together = _engine(path).generate(requests)
    chunked = _engine(path, max_prefill_size=16, max_seqs=3).generate(requests)
    small = dict(max_pages=24, max_seq_len=64, prefix_caching=False)
    preempting = _engine(path, **small)
    swapping = _engine(path, **small, host_kv_pages=64, preemption="swap")
    assert together == alone
    assert chunked == alone
    assert preempting.generate(requests) == alone and preempting.scheduler.num_preemptions > 0
    assert swapping.generate(requests) == alone and swapping.scheduler.kv.swapper.num_swaps > 0


def test_four_continuations_compute_their_context_once(tmp_path):
    """The first continuation's full context pages are cached as its step is scheduled: the other three map them,
    in the same step, and compute only what follows (the context's last token and the continuation: its logits
    score the continuation)."""
    make_hf_model("llama3", tmp_path)
    engine = _engine(tmp_path, max_prefill_size=256)
    engine.generate(_scored())
    page = 4
    cached = (len(CONTEXT) - 1) // page * page  # full pages before the context's last token
    assert engine.stats.prefix_cache_query_tokens == sum(len(CONTEXT) + len(c) for c in CONTINUATIONS)
    assert engine.stats.prefix_cache_hit_tokens == 3 * cached
    d2h = engine.stats.summary(8)
    assert d2h["device_to_host_bytes_prompt_logprobs"] > 0


@pytest.mark.parametrize("caching, prompt_logprobs", [(True, None), (False, None), (True, 2)])
def test_the_planner_counts_a_scored_rows_pages_and_prefill_tokens_exactly(tmp_path, caching, prompt_logprobs):
    """Four continuations of one length, run together with finished sequences keeping their pages
    (cleanup_mode=end): the pages in use at the end are the planner's (PackingLimits.page_need), and the prompt
    tokens computed its prefill tokens. With the prefix cache off, or with prompt_logprobs (each continuation
    computes every prompt token), the continuations share nothing."""
    from orchestrator.plan.continuation import new_tokens
    from orchestrator.plan.packing import PackingConfig, PackingLimits

    make_hf_model("llama3", tmp_path)
    continuations = [[40 + i, 41 + i, 42 + i, 43 + i, 44 + i] for i in range(4)]
    sampling = SamplingConfig(max_new_tokens=1, temperature=0.0, prompt_logprobs=prompt_logprobs)
    engine = _engine(tmp_path, max_prefill_size=256, prefix_caching=caching, cleanup_mode="end")
    limits = PackingLimits.resolve(PackingConfig(), engine.config, sampling)
    pages = int(limits.page_need(len(CONTEXT), new_tokens(continuations), len(continuations)))
    shared = (len(CONTEXT) - 1) // 4 if caching and prompt_logprobs is None else 0  # full pages before the last token
    assert pages == shared + 4 * (-(-(len(CONTEXT) + 6) // 4) - shared)
    for i, c in enumerate(continuations):
        assert engine.add_request(Request("q", tuple(CONTEXT + c), sampling, i, num_context_tokens=len(CONTEXT))) is None
    records = []
    while engine.has_unfinished:
        records += engine.step()
    assert len(records) == 4 and all(r.error is None for r in records)
    assert engine.snapshot()["pages_in_use"] == pages and engine.snapshot()["num_preemptions"] == 0
    assert sum(engine.stats.prefill_tokens) == limits.scored_prefill(CONTEXT, continuations)


def test_bad_continuations_are_reported(tmp_path):
    make_hf_model("llama3", tmp_path)
    [record] = _engine(tmp_path).generate([Request("q", (5, 6), GREEDY, num_context_tokens=2)])
    assert record.error.startswith("bad_continuation: a scored row needs a context and a continuation")
    with pytest.raises(ValueError, match="sampling.prompt_logprobs must be a count"):
        SamplingConfig(prompt_logprobs=-1)
