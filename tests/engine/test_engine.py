"""The engine loop: batch invariance, n samples sharing pages, stop strings, reset and cleanup, errors.

Greedy equality with transformers under continuous admission and preemption is tested through
`pagefleet generate` (tests/orchestrator/commands/test_generate.py), as users run it."""

from __future__ import annotations

import numpy as np
import pytest

from engine.config import EngineConfig, SamplingConfig
from engine.engine import Engine
from engine.models.presets import write_model
from engine.scheduling.sequence import Request
from tests.engine.models.hf_reference import varied_prompts


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return write_model("tiny-llama", tmp_path_factory.mktemp("tiny-llama"))


# The bit-identity tests run for each family with its own layer (Qwen3's QK-norm and head_dim, the mixtures of
# experts' grouped matmuls, whose rows share experts), on the native CPU kernel (`auto` on a float32 CPU pool) and,
# for Qwen3, on the reference attention. By default these run on Llama, Qwen3 on the reference attention and
# Qwen3-MoE, and under -m slow also on Qwen3 on the CPU kernel, Mixtral and Qwen2-MoE (its shared expert runs in row
# tiles, as a dense MLP): what differs between families is their layer, whose bits for a row every family's
# default run checks in tests/engine/models/test_row_bits.py (alone, beside and after other rows, in a prompt
# chunk or decoded); batching, the cache and preemption add no path of their own to them.
BIT_IDENTITY = [("tiny-llama", "auto"), ("tiny-qwen3", "auto"), ("tiny-qwen3", "reference"), ("tiny-mixtral", "auto"),
                ("tiny-qwen3-moe", "auto"), ("tiny-qwen2-moe", "auto")]
SLOW_ONLY = {("tiny-qwen3", "auto"), ("tiny-mixtral", "auto"), ("tiny-qwen2-moe", "auto")}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A preset's checkpoint, written once per module: `checkpoint(preset) -> path`."""
    paths = {}

    def get(preset: str):
        if preset not in paths:
            paths[preset] = write_model(preset, tmp_path_factory.mktemp(preset))
        return paths[preset]
    return get


@pytest.fixture(scope="module", ids=[f"{m}-{i}" for m, i in BIT_IDENTITY],
                params=[pytest.param(p, marks=pytest.mark.slow) if p in SLOW_ONLY else p for p in BIT_IDENTITY])
def model_impl(request, checkpoint):
    """(a preset's checkpoint, the attention_impl its engines use)."""
    preset, impl = request.param
    return checkpoint(preset), impl


# 16 prompts in the default run (both batchings: max_seqs 16, and max_seqs 3 with 4-token pages); 64 under -m slow.
@pytest.mark.parametrize("count", [16, pytest.param(64, marks=pytest.mark.slow)])
@pytest.mark.parametrize("preset, impl", [pytest.param(*p, marks=pytest.mark.slow) if p in SLOW_ONLY else p
                                          for p in BIT_IDENTITY], ids=[f"{m}-{i}" for m, i in BIT_IDENTITY])
def test_sample_does_not_depend_on_its_batch(checkpoint, preset, impl, count):
    """The same (prompt, seed) gives the same tokens run alone, shuffled inside a batch of `count`, and under
    other max_seqs, page_size and max_pages: greedy, and with temperature 0.8 / top-p 0.9 / top-k 50."""
    path = checkpoint(preset)
    prompts = varied_prompts(512, count=count, seed=5)  # 1 to 400 tokens
    settings = [SamplingConfig(max_new_tokens=10, temperature=0.0, seed=3),
                SamplingConfig(max_new_tokens=10, temperature=0.8, top_p=0.9, top_k=50, seed=3)]
    engines = [Engine(path, config) for config in (
        EngineConfig(max_pages=200, max_seqs=16, max_seq_len=512, attention_impl=impl),
        EngineConfig(page_size=4, max_pages=150, max_seqs=3, max_seqs_in_prefill=2, max_prefill_size=64,
                     max_seq_len=512, attention_impl=impl))]  # each runs both settings, one after the other
    # A prompt alone in its steps, under the first batching's settings: its steps are of other sizes than in a
    # batch (its own length's bucket), and it compiles no programs of its own.
    alone = Engine(path, engines[0].config)
    for sampling in settings:
        requests = [Request(f"q{i}", tuple(p), sampling) for i, p in enumerate(prompts)]
        reference = {r.prompt_id: alone.generate([r])[0].token_ids for r in requests[:8]}  # the 7 edge lengths too
        batched = []
        for engine in engines:
            shuffled = list(requests)
            np.random.default_rng(1).shuffle(shuffled)
            got = {c.prompt_id: c.token_ids for c in engine.generate(shuffled)}
            for pid, tokens in reference.items():
                assert got[pid] == tokens, f"{pid} with {sampling} under {engine.config}"
            batched.append(got)
        assert batched[0] == batched[1], f"the two batchings differ with {sampling}"  # every prompt


def test_bad_requests_are_reported_and_the_rest_complete(tiny_llama):
    path = tiny_llama
    engine = Engine(path, EngineConfig(max_pages=64, max_seq_len=256))
    s = SamplingConfig(max_new_tokens=8)
    out = engine.generate([Request("ok", (10, 11, 12), s), Request("empty", (), s),
                           Request("long", tuple([7] * 250), s), Request("ok2", (13,), s)])
    by_id = {c.prompt_id: c for c in out}
    assert by_id["empty"].error.startswith("empty_prompt: ")  # the reasons a run writes to rejected.jsonl
    assert by_id["long"].error.startswith("too_long: ")
    assert "258" in by_id["long"].error and "engine.max_seq_len" in by_id["long"].error
    assert by_id["ok"].error is None and len(by_id["ok"].token_ids) > 0
    assert by_id["ok2"].error is None


def test_capacity_that_cannot_hold_one_sequence_is_refused(tiny_llama):
    path = tiny_llama
    with pytest.raises(ValueError, match=r"engine.max_pages=4 .* at least 32"):
        Engine(path, EngineConfig(page_size=16, max_pages=4, max_seq_len=512))


@pytest.mark.parametrize("prompt_len", [45, 48])  # several pages with a partial last page; page-aligned
def test_n_samples_share_prompt_pages_and_equal_single_runs(tiny_llama, prompt_len):
    n, ps = 4, 16
    sampling = SamplingConfig(max_new_tokens=8, temperature=0.8, top_p=0.9, top_k=50, seed=11)
    prompts = varied_prompts(512, count=8, seed=9)
    prompts = [p[:prompt_len] + [7] * (prompt_len - len(p[:prompt_len])) for p in prompts[:3]]
    # max_seqs=6 holds one group of n=4 at a time: admitting a second parent would overflow once it forks.
    engine = Engine(tiny_llama, EngineConfig(page_size=ps, max_pages=64, max_seqs=6, max_seqs_in_prefill=6,
                                             max_seq_len=256,
                                             debug_invariants=True))
    requests = [Request(f"s{i}", tuple(p), sampling, generation_index=g) for i, p in enumerate(prompts)
                for g in range(n)]
    for r in requests:
        assert engine.add_request(r) is None
    assert len(engine.scheduler.waiting) == len(prompts)  # one queued sequence per prompt, siblings attached
    results, saw_sharing = {}, False
    while engine.has_unfinished:
        for c in engine.step():
            results[(c.prompt_id, c.generation_index)] = c
        alloc = engine.scheduler.allocator
        for seq in engine.scheduler.running:
            if seq.request.generation_index == 0 and len(seq.token_ids) == prompt_len + 1:
                full = prompt_len // ps
                assert [alloc.refcount(p) for p in seq.pages[0][:full]] == [n] * full  # full pages shared by all n
                if prompt_len % ps:
                    assert alloc.refcount(seq.pages[0][full]) == 1  # the partial last page was copied
                saw_sharing = True
    assert saw_sharing
    samples = {g: results[("s0", g)].token_ids for g in range(n)}
    assert len({tuple(t) for t in samples.values()}) > 1, "different generation indices draw different streams"
    for r in requests:
        alone = Engine(tiny_llama, EngineConfig(page_size=ps, max_pages=64, max_seq_len=256)).generate([r])[0]
        assert results[(r.prompt_id, r.generation_index)].token_ids == alone.token_ids, (r.prompt_id, r.generation_index)


def test_n_samples_fork_in_a_step_with_an_unfinished_prompt_chunk(tiny_llama):
    """A parent's prompt completes (its siblings fork and draw their first token) in the same step as the
    first chunk of a longer prompt, which draws no token: each row must still reach its own sequence."""
    n = 2
    sampling = SamplingConfig(max_new_tokens=6, temperature=0.8, seed=5)
    rng = np.random.default_rng(4)
    prompts = [rng.integers(6, 512, length).tolist() for length in (40, 90, 20, 70)]
    engine = Engine(tiny_llama, EngineConfig(page_size=8, max_pages=96, max_seqs=8, max_seqs_in_prefill=4,
                                             max_prefill_size=64, max_seq_len=128, debug_invariants=True))
    requests = [Request(f"f{i}", tuple(p), sampling, generation_index=g) for i, p in enumerate(prompts)
                for g in range(n)]
    results = {(c.prompt_id, c.generation_index): c.token_ids for c in engine.generate(requests)}
    for r in requests:
        alone = Engine(tiny_llama, EngineConfig(page_size=16, max_pages=64, max_seq_len=256)).generate([r])[0]
        assert results[(r.prompt_id, r.generation_index)] == alone.token_ids, (r.prompt_id, r.generation_index)


def test_stop_strings_spanning_tokens_cut_at_the_right_place(tiny_llama):
    engine = Engine(tiny_llama, EngineConfig(max_pages=64, max_seq_len=256))
    tok = engine.tokenizer
    prompt = tuple(tok("the river and the moon")["input_ids"])
    free = engine.generate([Request("p", prompt, SamplingConfig(max_new_tokens=24))])[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 24
    pieces = [tok.decode([t]) for t in free.token_ids]
    text = "".join(pieces)
    assert text == free.completion
    # A stop string made of the end of token 5's text and the start of token 6's: it spans a boundary.
    k = next(i for i in range(4, 20) if len(pieces[i]) >= 1 and len(pieces[i + 1]) >= 1 and "\ufffd" not in
             pieces[i] + pieces[i + 1])
    start = sum(len(p) for p in pieces[:k]) + len(pieces[k]) - 1
    stop = text[start:start + 2]
    cut = text.index(stop)
    out = engine.generate([Request("p", prompt, SamplingConfig(max_new_tokens=24, stop=[stop]))])[0]
    assert out.finish_reason == "stop"
    assert out.completion == text[:cut]
    assert out.token_ids == free.token_ids[:len(out.token_ids)]
    assert "".join(pieces[:len(out.token_ids)]).find(stop) >= 0  # stopped on the token that completed it
    assert "".join(pieces[:len(out.token_ids) - 1]).find(stop) < 0


def test_logical_reset_frees_everything_and_repeats_outputs(tiny_llama):
    engine = Engine(tiny_llama, EngineConfig(max_pages=64, max_seq_len=256, reset_mode="logical"))
    requests = [Request(f"r{i}", tuple(range(10 + i, 30 + 3 * i)), SamplingConfig(max_new_tokens=6, temperature=0.8,
                                                                                  seed=2)) for i in range(5)]
    first = engine.generate(requests)
    assert engine.scheduler.allocator.num_free == 64 and engine.scheduler.allocator.max_refcount == 0
    assert float(abs(engine.runner.kv.pool.array).max()) > 0  # logical reset leaves the pool's bytes alone
    second = engine.generate(requests)
    assert [c.token_ids for c in first] == [c.token_ids for c in second]


def test_physical_reset_zeroes_the_pool(tiny_llama):
    engine = Engine(tiny_llama, EngineConfig(max_pages=64, max_seq_len=256, reset_mode="physical"))
    engine.generate([Request("a", (5, 6, 7, 8), SamplingConfig(max_new_tokens=4))])
    assert engine.scheduler.allocator.num_free == 64
    assert float(abs(engine.runner.kv.pool.array).max()) == 0.0


@pytest.mark.parametrize("mode", ["incremental", "end", "none"])
def test_cleanup_modes(tiny_llama, mode):
    engine = Engine(tiny_llama, EngineConfig(page_size=4, max_pages=128, max_seqs=4, max_seqs_in_prefill=4, max_seq_len=256,
                                             cleanup_mode=mode, debug_invariants=True))
    short = Request("short", (5, 6, 7), SamplingConfig(max_new_tokens=2))
    long = Request("long", tuple(range(8, 30)), SamplingConfig(max_new_tokens=12))
    for r in (short, long):
        engine.add_request(r)
    used_after_short = None
    while engine.has_unfinished:
        for c in engine.step():
            if c.prompt_id == "short":
                used_after_short = engine.scheduler.allocator.num_used
    # A finished sequence holds the pages of its cached tokens: the last sampled token is never cached.
    long_pages, short_pages = -(-(22 + 12 - 1) // 4), -(-(3 + 2 - 1) // 4)
    if mode == "incremental":  # the short sequence's pages came back as soon as it finished
        assert used_after_short <= long_pages
        assert engine.scheduler.allocator.num_used == 0
    else:  # finished sequences keep their pages through the call
        assert engine.scheduler.allocator.num_used == long_pages + short_pages
    if mode == "end":
        engine.release_finished()  # what generate() does at the end of a call
        assert engine.scheduler.allocator.num_used == 0
    if mode == "none":
        engine.reset()
        assert engine.scheduler.allocator.num_used == 0


@pytest.mark.parametrize("max_seqs,expected", [
    (64, {1: 4, 4: 4, 5: 16, 16: 16, 17: 64, 33: 64, 64: 64}),
    (100, {17: 64, 65: 128, 100: 128}),  # capped at the steps with prompt chunks' bucket (128), not 256
    (8, {3: 4, 5: 8, 8: 8}),
])
def test_decode_rows_are_padded_to_powers_of_four_up_to_the_max_seqs_bucket(max_seqs, expected):
    from types import SimpleNamespace

    from engine.device.runner import ModelRunner

    runner = SimpleNamespace(config=EngineConfig(max_seqs=max_seqs, max_seqs_in_prefill=1))
    assert {n: ModelRunner.decode_bucket(runner, n) for n in expected} == expected


def test_completions_leave_special_tokens_out_and_special_stop_strings_still_fire(tiny_llama):
    """A completion is the text of its tokens without special tokens (`<|end|>` is markup); a stop string
    that names a special token still stops the sample on it."""
    engine = Engine(tiny_llama, EngineConfig(max_pages=64, max_seq_len=256))
    tok = engine.tokenizer
    special = {tok.convert_tokens_to_ids(t) for t in tok.all_special_tokens} - engine.eos_token_ids
    sampling = SamplingConfig(max_new_tokens=32, temperature=4.0, seed=1)  # hot: every token has a chance
    prompts = [tuple(tok(f"the river and the moon {i}")["input_ids"]) for i in range(16)]
    out = engine.generate([Request(f"p{i}", p, sampling) for i, p in enumerate(prompts)])
    hits = [c for c in out if special & set(c.token_ids)]
    assert hits, "the seeded samples should draw a special token for this test to mean anything"
    for c in out:
        text_ids = [t for t in c.token_ids if t not in engine.eos_token_ids]
        assert c.completion == tok.decode(text_ids, skip_special_tokens=True)
        assert not any(t in c.completion for t in tok.all_special_tokens)
    c = hits[0]
    first = next(i for i, t in enumerate(c.token_ids) if t in special)
    marker = tok.convert_ids_to_tokens(c.token_ids[first])
    i = int(c.prompt_id[1:])
    stopped = engine.generate([Request(c.prompt_id, prompts[i], SamplingConfig(max_new_tokens=32, temperature=4.0,
                                                                               seed=1, stop=[marker]))])[0]
    assert stopped.finish_reason == "stop" and stopped.token_ids == c.token_ids[:first + 1]
    assert stopped.completion == tok.decode(c.token_ids[:first], skip_special_tokens=False)


def _shared_prefix_requests(n: int, temperature: float) -> list[Request]:
    """12 prompts behind two shared blocks (100 and 37 tokens), n samples each."""
    rng = np.random.default_rng(8)
    blocks = [rng.integers(6, 512, 100).tolist(), rng.integers(6, 512, 37).tolist()]
    prompts = [blocks[i % 2] + rng.integers(6, 512, int(rng.integers(1, 30))).tolist() for i in range(12)]
    sampling = SamplingConfig(max_new_tokens=12, temperature=temperature, top_p=0.9, seed=4, n=n, logprobs=True)
    return [Request(f"c{i}", tuple(p), sampling, generation_index=g) for i, p in enumerate(prompts) for g in range(n)]


def _two_batches(path, impl: str, requests, **engine) -> tuple[dict, int, int]:
    """Samples of one engine (attention `impl`) fed two batches (two calls), the cache's hit tokens, the preemptions."""
    eng = Engine(path, EngineConfig(page_size=8, max_seqs=6, max_seqs_in_prefill=3, max_prefill_size=32, max_seq_len=160,
                                    debug_invariants=True, attention_impl=impl, **engine))
    out, hits = [], 0
    for batch in (requests[:10], requests[10:]):
        out += eng.generate(batch)
        hits += eng.stats.prefix_cache_hit_tokens
    return {(c.prompt_id, c.generation_index): (c.token_ids, c.logprobs) for c in out}, hits, eng.scheduler.num_preemptions


def _tokens(samples: dict) -> dict:
    return {k: tokens for k, (tokens, _) in samples.items()}


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_prefix_cache_on_and_off_give_the_same_tokens(model_impl, temperature):
    """Prompts sharing long prefixes within a batch and across batches (two calls of one engine), n = 2,
    chunked prefill (32-token steps): the tokens are the same with the cache on and off, and every prompt after
    the first of its block maps that block's full pages."""
    requests = _shared_prefix_requests(2, temperature)
    on, hits, _ = _two_batches(*model_impl, requests, max_pages=400, prefix_caching=True)
    off, no_hits, _ = _two_batches(*model_impl, requests, max_pages=400, prefix_caching=False)
    assert _tokens(on) == _tokens(off)
    assert no_hits == 0 and hits == 5 * 96 + 5 * 32, hits


def test_prefix_cache_on_and_off_give_bit_identical_logprobs(model_impl):
    """A sequence that maps cached pages computes only its suffix, in steps of other shapes than with the cache
    off: its tokens and logprobs are still the same bits (the model and sampler run in fixed row tiles)."""
    requests = _shared_prefix_requests(2, 0.0)
    on, _, _ = _two_batches(*model_impl, requests, max_pages=400, prefix_caching=True)
    off, _, _ = _two_batches(*model_impl, requests, max_pages=400, prefix_caching=False)
    assert on == off


def test_prefix_cache_under_preemption_gives_the_same_tokens(model_impl):
    """A pool that preempts: cached pages outlive the preempted sequences, and the tokens are the same with the
    cache on and off."""
    requests = _shared_prefix_requests(2, 0.8)
    on, hits, preempted_on = _two_batches(*model_impl, requests, max_pages=24, prefix_caching=True)
    off, _, preempted_off = _two_batches(*model_impl, requests, max_pages=24, prefix_caching=False)
    assert preempted_on > 0 and preempted_off > 0 and hits > 0
    assert _tokens(on) == _tokens(off)


def test_recompute_after_preemption_keeps_logprobs_bit_identical(model_impl):
    """A token's KV recomputed in a prompt step after a preemption is the KV its decode step wrote, bit for bit,
    so the samples of a pool that preempts are those of an ample one."""
    requests = _shared_prefix_requests(1, 0.8)
    ample, _, none = _two_batches(*model_impl, requests, max_pages=400, prefix_caching=False)
    small, _, preempted = _two_batches(*model_impl, requests, max_pages=24, prefix_caching=False)
    assert none == 0 and preempted > 0
    assert small == ample
