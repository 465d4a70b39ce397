"""Every sampling kind in one run: rows with random settings drawn from all of them (greedy and seeded, top-k, top-p,
min-p, the three penalties, stop ids, stop strings, min_tokens, ignore_eos, n = 2, prompt_logprobs, a structured
choice, a scored continuation, shared prompt prefixes), run together under multi-step pipelined decode, the prefix
cache and swap preemption, and under single steps with recompute preemption, give each row the record it gets alone,
every field of it. The other tests hold one setting
a batch; this one holds their mix, where a row's program mode, its stop ids and its pages change with its neighbours."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from engine.config import EngineConfig, SamplingConfig
from engine.engine import Engine
from engine.models.presets import write_model
from engine.scheduling.sequence import Request

BASE = dict(page_size=8, max_seq_len=96, debug_invariants=True)


@pytest.fixture(scope="module", params=["tiny-llama", pytest.param("tiny-gemma3", marks=pytest.mark.slow)])
def model(request, tmp_path_factory):
    return write_model(request.param, tmp_path_factory.mktemp(request.param))


def _prompts(rng, vocab: int, count: int) -> list[tuple[int, ...]]:
    """Prompts of 3-30 tokens; every other one starts with one of two 17-token prefixes (two full pages)."""
    prefixes = [rng.integers(6, vocab, 17).tolist() for _ in range(2)]
    return [tuple((prefixes[i % 4 // 2] if i % 2 else []) + rng.integers(6, vocab, int(rng.integers(3, 14))).tolist())
            for i in range(count)]


KINDS = ("penalties", "stop_ids", "min_tokens", "stop", "n", "ignore_eos", "prompt_logprobs")


def _sampling(rng, i: int, frequent: list[int], texts: list[str]) -> SamplingConfig:
    """Row i's settings: greedy or seeded with random truncation, and each of KINDS in about a third of the rows,
    at least every third row for each (so every kind is in every mix); row 5 a structured choice."""
    temperature = float(rng.choice([0.0, 0.7, 1.3]))
    kw: dict = dict(max_new_tokens=int(rng.integers(3, 24)), temperature=temperature, logprobs=True,
                    seed=int(rng.integers(0, 1000)))
    if temperature:
        kw.update(top_k=int(rng.choice([0, 12])), top_p=float(rng.choice([1.0, 0.9])),
                  min_p=float(rng.choice([0.0, 0.05])))
    has = {kind for j, kind in enumerate(KINDS) if (i + j) % 3 == 0 or rng.random() < 0.15}
    if "penalties" in has:
        kw.update(repetition_penalty=float(rng.choice([1.0, 0.8, 1.4])), presence_penalty=float(rng.choice([0, 0.6])),
                  frequency_penalty=float(rng.choice([0.9, -0.4])))
    if "stop_ids" in has:
        kw["stop_token_ids"] = [int(t) for t in rng.choice(frequent, 2, replace=False)]
    if "min_tokens" in has:
        kw["min_tokens"] = int(rng.integers(1, kw["max_new_tokens"] + 1))
    if "stop" in has:
        kw["stop"] = [str(rng.choice(texts))]
    if "n" in has:
        kw["n"] = 2
    if "prompt_logprobs" in has:
        kw["prompt_logprobs"] = 2
    if i == 5:
        return SamplingConfig(**{**kw, "choice": ["yes", "no", "maybe so"], "min_tokens": 0})
    return SamplingConfig(**kw, ignore_eos="ignore_eos" in has)


def _requests(eng: Engine, count: int, seed: int) -> list[Request]:
    rng = np.random.default_rng(seed)
    prompts = _prompts(rng, eng.tokenizer.vocab_size, count)
    free = eng.generate([Request(f"f{i}", p, SamplingConfig(max_new_tokens=24)) for i, p in enumerate(prompts)],
                        reset=True)
    counts = Counter(t for c in free for t in c.token_ids[1:])
    frequent = [t for t, _ in counts.most_common(12)]  # ids the samples draw: stop ids that bite
    texts = [c.completion[k:k + 2] for c in free for k in (3, 9)
             if c.completion[k:k + 2].isprintable() and c.completion[k:k + 2].strip()]  # stop strings that bite
    out = []
    for i, p in enumerate(prompts):
        s = _sampling(rng, i, frequent, texts)
        if i % 7 == 6:  # a scored row: its last (up to 3) tokens' log-likelihood given the rest
            out.append(Request(f"r{i}", p, SamplingConfig(max_new_tokens=1, prompt_logprobs=s.prompt_logprobs),
                               num_context_tokens=max(1, len(p) - 3)))
        else:
            out += [Request(f"r{i}", p, s, generation_index=g) for g in range(s.n)]
    return out


def _samples(out) -> dict:
    assert all(c.error is None for c in out), [c.error for c in out if c.error]
    return {(c.prompt_id, c.generation_index): c.to_json() for c in out}  # every field of the record


@pytest.mark.parametrize("seed", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_a_mix_of_every_sampling_kind_gives_each_row_its_samples_alone(model, seed):
    alone_engine = Engine(model, EngineConfig(max_pages=64, max_seqs=4, max_prefill_size=64, decode_steps=1,
                                              prefix_caching=False, **BASE))
    requests = _requests(alone_engine, 14, seed)
    by_prompt: dict[str, list[Request]] = {}
    for r in requests:
        by_prompt.setdefault(r.prompt_id, []).append(r)
    alone = {}
    for group in by_prompt.values():  # a prompt's n samples together: they are one prompt's
        alone |= _samples(alone_engine.generate(group, reset=True))

    engines = {  # every row admitted at once, then multi-step pipelined decode calls
        "multi-step": EngineConfig(max_pages=40, max_seqs=24, max_seqs_in_prefill=8, max_prefill_size=128,
                                   decode_steps=4, **BASE),
        # a pool too small for the mix: rows swapped out and back, or dropped and recomputed
        "swap": EngineConfig(max_pages=14, max_seqs=8, max_seqs_in_prefill=4, max_prefill_size=48, decode_steps=4,
                             preemption="swap", host_kv_pages=48, **BASE),
        "recompute": EngineConfig(max_pages=12, max_seqs=5, max_seqs_in_prefill=3, max_prefill_size=40,
                                  decode_steps=1, preemption="recompute", **BASE)}
    for name, config in engines.items():
        eng = Engine(model, config)
        together = _samples(eng.generate(requests))
        assert {k: v["token_ids"] for k, v in together.items()} == {k: v["token_ids"] for k, v in alone.items()}, name
        assert together == alone, name
        if name == "multi-step":
            assert sum(n > 1 for n in eng.stats.model_steps) >= 3 and eng.scheduler.num_preemptions == 0
        else:
            assert eng.scheduler.num_preemptions > 0, name
    kinds = [r.sampling for r in requests]
    assert {s.temperature > 0 for s in kinds} == {True, False} and any(s.penalizes for s in kinds)
    assert all(any(getattr(s, kind) for s in kinds) for kind in ("min_tokens", "stop", "stop_token_ids", "ignore_eos",
                                                                 "structured"))
    assert {c["finish_reason"] for c in alone.values()} >= {"stop", "length"}
    assert any(r.is_scored for r in requests) and any(s.prompt_logprobs for s in kinds)
