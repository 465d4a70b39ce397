"""min_p, repetition / presence / frequency penalties and stop_token_ids (sampling.*): transformers' greedy with the
same logits processors, a numpy reference of the penalty formula, and the same tokens in single and multi-step
decode."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from engine.config import EngineConfig, SamplingConfig
from engine.engine import Engine
from engine.sampling.sampler import penalize, penalty_state, sample, sample_base_key, position_keys
from engine.scheduling.sequence import Request
from tests.engine.models.hf_reference import make_hf_model, varied_prompts

VOCAB = 256
EOS = 2


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama3")
    return path, make_hf_model("llama3", path, vocab=VOCAB)


def engine(path, decode_steps: int = 4, **config) -> Engine:
    return Engine(path, EngineConfig(**{"page_size": 8, "max_pages": 128, "max_seqs": 4, "max_seqs_in_prefill": 4,
                                        "max_prefill_size": 256, "max_seq_len": 256, "decode_steps": decode_steps,
                                        **config}))


def prompts(count: int = 4) -> list[list[int]]:
    """Short prompts with repeated tokens (so the repetition penalty bites on prompt tokens)."""
    rng = np.random.default_rng(1)
    out = []
    for n in (5, 12, 20, 31)[:count]:
        base = rng.integers(6, VOCAB, n // 2 + 1).tolist()
        out.append((base * 2)[:n])
    return out


def hf_generate(model, prompt: list[int], max_new_tokens: int, **processors) -> list[int]:
    """transformers' greedy `generate` with its logits processors (repetition_penalty=, min_p=), stopping at EOS."""
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=EOS, pad_token_id=0,
                         **processors)
    tokens = out[0, len(prompt):].tolist()
    return tokens[:tokens.index(EOS) + 1] if EOS in tokens else tokens


def reference_penalized_greedy(model, prompt: list[int], max_new_tokens: int, presence: float, frequency: float,
                               repetition: float = 1.0) -> list[int]:
    """Greedy over transformers' logits with the penalties written out in numpy (vLLM's formula)."""
    tokens = list(prompt)
    out: list[int] = []
    for _ in range(max_new_tokens):
        with torch.no_grad():
            logits = model(torch.tensor([tokens])).logits[0, -1].double().numpy()
        counts = np.bincount(np.asarray(out, dtype=np.int64), minlength=VOCAB)
        seen = np.zeros(VOCAB, bool)
        seen[tokens] = True
        logits = np.where(seen, np.where(logits > 0, logits / repetition, logits * repetition), logits)
        logits = logits - frequency * counts - presence * (counts > 0)
        token = int(np.argmax(logits))
        out.append(token)
        tokens.append(token)
        if token == EOS:
            break
    return out


@pytest.mark.parametrize("decode_steps", [1, 4])
def test_repetition_penalty_equals_transformers_greedy(hf_model, decode_steps):
    path, model = hf_model
    eng = engine(path, decode_steps)
    for penalty in (1.5, 0.7):
        sampling = SamplingConfig(max_new_tokens=24, repetition_penalty=penalty)
        got = eng.generate([Request(f"p{i}", tuple(p), sampling) for i, p in enumerate(prompts())])
        plain = eng.generate([Request(f"p{i}", tuple(p), SamplingConfig(max_new_tokens=24))
                              for i, p in enumerate(prompts())])
        for p, c, c0 in zip(prompts(), got, plain):
            assert c.token_ids == hf_generate(model, p, 24, repetition_penalty=penalty)
        assert any(c.token_ids != c0.token_ids for c, c0 in zip(got, plain)), "the penalty must change a sample"


@pytest.mark.parametrize("decode_steps", [1, 4])
def test_min_p_with_temperature_zero_equals_transformers_greedy(hf_model, decode_steps):
    path, model = hf_model
    eng = engine(path, decode_steps)
    sampling = SamplingConfig(max_new_tokens=16, min_p=0.2)
    got = eng.generate([Request(f"p{i}", tuple(p), sampling) for i, p in enumerate(prompts())])
    for p, c in zip(prompts(), got):
        assert c.token_ids == hf_generate(model, p, 16, min_p=0.2)


def test_presence_and_frequency_penalties_equal_a_numpy_reference(hf_model):
    path, model = hf_model
    eng = engine(path, 4)
    cases = [(0.0, 2.0, 1.0), (1.5, 0.0, 1.0), (0.5, 0.7, 1.2)]
    for presence, frequency, repetition in cases:
        sampling = SamplingConfig(max_new_tokens=20, presence_penalty=presence, frequency_penalty=frequency,
                                  repetition_penalty=repetition)
        got = eng.generate([Request(f"p{i}", tuple(p), sampling) for i, p in enumerate(prompts(3))])
        for p, c in zip(prompts(3), got):
            assert c.token_ids == reference_penalized_greedy(model, p, 20, presence, frequency, repetition)


def test_penalized_samples_are_the_same_in_single_and_multi_step_decode(hf_model):
    """Seeded and greedy rows with penalties, mixed with rows without: every inner step of a multi-step call
    (pipelined or not) counts the tokens before it exactly as single steps do."""
    path, _ = hf_model
    seeded = SamplingConfig(max_new_tokens=30, temperature=0.9, top_p=0.95, min_p=0.05, seed=4, n=2,
                            presence_penalty=0.8, frequency_penalty=0.5, repetition_penalty=1.3, logprobs=True)
    greedy = SamplingConfig(max_new_tokens=25, frequency_penalty=1.0, logprobs=True)
    plain = SamplingConfig(max_new_tokens=18, temperature=0.7, seed=1, logprobs=True)
    ps = prompts()
    requests = ([Request("s0", tuple(ps[0]), seeded, g) for g in range(2)] + [Request("g1", tuple(ps[1]), greedy)]
                + [Request("x2", tuple(ps[2]), plain), Request("s3", tuple(ps[3]), seeded)])
    ref = engine(path, 1).generate(requests)
    assert ref[0].token_ids != ref[1].token_ids
    for steps, pipeline in ((4, True), (4, False), (8, True)):
        got = engine(path, steps, pipeline_decode=pipeline).generate(requests)
        assert [c.token_ids for c in got] == [c.token_ids for c in ref], (steps, pipeline)
        for c, r in zip(got, ref):
            np.testing.assert_allclose(c.logprobs, r.logprobs, atol=1e-5)


@pytest.mark.parametrize("decode_steps", [1, 4])
def test_stop_token_ids_end_a_sample_as_eos_does(hf_model, decode_steps):
    path, _ = hf_model
    eng = engine(path, decode_steps)
    p = prompts()[2]
    free = eng.generate([Request("a", tuple(p), SamplingConfig(max_new_tokens=20))])[0].token_ids
    stop_at = next(i for i in range(2, len(free)) if free[i] not in free[:i])
    got = eng.generate([Request("a", tuple(p), SamplingConfig(max_new_tokens=20, stop_token_ids=[free[stop_at]])),
                        Request("b", tuple(p), SamplingConfig(max_new_tokens=20))])
    assert got[0].token_ids == free[:stop_at + 1] and got[0].finish_reason == "stop"
    assert got[1].token_ids == free  # another row of the same call is not stopped by it
    bad = eng.generate([Request("c", tuple(p), SamplingConfig(max_new_tokens=5, stop_token_ids=[VOCAB]))])[0]
    assert bad.error.startswith("out_of_vocabulary: sampling.stop_token_ids")


def test_a_device_stop_the_host_does_not_share_is_an_error_not_a_hang(hf_model):
    """Multi-step calls stop rows on the device at stop ids the host must stop at too; were they ever to differ
    (an engine fault), the host would wait on the stopped row forever. The step that reads it says so instead."""
    path, _ = hf_model
    eng = engine(path, 4)
    sampling = SamplingConfig(max_new_tokens=24)
    free = eng.generate([Request("p0", tuple(prompts(1)[0]), sampling)])[0].token_ids
    at = next(i for i in range(2, len(free)) if free[i] not in free[:i])  # drawn in a multi-step call
    eng.runner.stop_ids = sorted({*eng.runner.stop_ids, free[at]})  # the device's alone
    eng.add_request(Request("p0", tuple(prompts(1)[0]), sampling))
    with pytest.raises(RuntimeError, match=f"engine fault: the device stopped prompt 'p0'.s sample 0 at token "
                                           f"{free[at]}, which the host does not stop at"):
        for _ in range(50):  # the free sample ends in 7 calls or fewer
            assert eng.has_unfinished, "the sample finished although its device stopped it at a token the host runs on"
            eng.step()


def test_penalize_is_the_numpy_formula():
    rng = np.random.default_rng(0)
    S, V = 5, 40
    logits = rng.normal(scale=3, size=(S, V)).astype(np.float32)
    history = np.full((S, 12), -1, np.int32)
    prompt_lens = np.array([3, 0, 5, 2, 4], np.int32)
    lengths = [7, 4, 12, 2, 9]
    for r, n in enumerate(lengths):
        history[r, :n] = rng.integers(0, V, n)
    rep = np.array([1.0, 1.4, 0.8, 2.0, 1.1], np.float32)
    pres = np.array([0.0, 0.5, -0.3, 1.0, 0.2], np.float32)
    freq = np.array([0.3, 0.0, 0.4, -0.5, 1.0], np.float32)
    in_prompt, counts = penalty_state(jnp.asarray(history), jnp.asarray(prompt_lens), V)
    got = np.asarray(penalize(jnp.asarray(logits), in_prompt, counts, jnp.asarray(rep), jnp.asarray(pres),
                              jnp.asarray(freq)))
    for r, n in enumerate(lengths):
        prompt, completion = history[r, :prompt_lens[r]], history[r, prompt_lens[r]:n]
        c = np.bincount(completion, minlength=V)
        seen = np.zeros(V, bool)
        seen[prompt] = True
        seen[completion] = True
        x = logits[r].astype(np.float64)
        x = np.where(seen, np.where(x > 0, x / rep[r], x * rep[r]), x)
        x = x - freq[r] * c - pres[r] * (c > 0)
        np.testing.assert_allclose(got[r], x, rtol=1e-6, atol=1e-6)


def test_min_p_keeps_only_tokens_near_the_top_probability():
    rng = np.random.default_rng(2)
    S, V = 64, 50
    logits = jnp.asarray(rng.normal(scale=2, size=(1, V)).astype(np.float32).repeat(S, 0))
    temperature = jnp.full((S,), 0.8, jnp.float32)
    base = jnp.asarray(np.stack([sample_base_key(3, "p", g) for g in range(S)]))
    keys = position_keys(base, jnp.zeros(S, jnp.int32))
    ones, zeros = jnp.ones(S, jnp.float32), jnp.zeros(S, jnp.int32)
    tokens, _ = sample(logits, temperature, zeros, ones, keys, min_p=jnp.full((S,), 0.3, jnp.float32))
    probs = np.exp(np.asarray(logits[0]) / 0.8)
    probs /= probs.sum()
    allowed = set(np.flatnonzero(probs >= 0.3 * probs.max()).tolist())
    assert set(np.asarray(tokens).tolist()) <= allowed and len(allowed) < V
    # min_p 0 draws what no min_p draws; a program without min_p is the same program as before.
    off, _ = sample(logits, temperature, zeros, ones, keys, min_p=jnp.zeros(S, jnp.float32))
    none, _ = sample(logits, temperature, zeros, ones, keys)
    np.testing.assert_array_equal(np.asarray(off), np.asarray(none))


def test_a_job_without_penalties_or_min_p_leaves_them_out_of_its_programs(hf_model, monkeypatch):
    from engine.device import device_calls, runner as runner_module
    path, _ = hf_model

    def traced(*args, **kwargs):
        raise AssertionError("a penalty program was traced")

    monkeypatch.setattr(device_calls, "penalize", traced)
    monkeypatch.setattr(runner_module, "_penalty_state", traced)
    plain = SamplingConfig(max_new_tokens=6, temperature=0.8, top_k=20, seed=2)
    shapes = dict(max_seqs=3, max_seqs_in_prefill=3, max_prefill_size=24, max_pages=70)  # fresh programs
    engine(path, 4, **shapes).generate([Request("a", tuple(prompts()[0]), plain)])
    with pytest.raises(AssertionError, match="penalty program was traced"):
        engine(path, 4, **shapes).generate(
            [Request("a", tuple(prompts()[0]), dataclasses.replace(plain, presence_penalty=0.5))])


def test_penalized_samples_on_a_mesh_equal_one_device(hf_model):
    """The penalty state is placed on the mesh the step runs on (replicated), single and multi-step."""
    from engine.distributed import slice_mesh

    path, _ = hf_model
    sampling = SamplingConfig(max_new_tokens=12, temperature=0.8, seed=2, repetition_penalty=1.3,
                              frequency_penalty=0.4)
    requests = [Request(f"p{i}", tuple(p), sampling) for i, p in enumerate(prompts(3))]
    ref = engine(path, 4).generate(requests)
    for steps in (1, 4):
        got = Engine(path, EngineConfig(page_size=8, max_pages=128, max_seqs=4, max_seqs_in_prefill=4,
                                        max_prefill_size=256, max_seq_len=256, decode_steps=steps),
                     mesh=slice_mesh(2)).generate(requests)
        assert [c.token_ids for c in got] == [c.token_ids for c in ref]
