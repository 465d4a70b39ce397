"""engine/sampling/sampler.py: greedy and truncated sampling, batch invariance, and the key derivation."""

from __future__ import annotations

import hashlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine.sampling.sampler import greedy_sample, position_keys, sample, sample_base_key, sample_key

VOCAB = 128
SETTINGS = [  # (temperature, top_k, top_p)
    (0.8, 50, 0.9),
    (1.0, 0, 1.0),
    (0.5, 5, 1.0),
    (1.3, 0, 0.7),
    (0.0, 0, 1.0),
]


def _logits(rows: int, vocab: int = VOCAB, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(scale=3.0, size=(rows, vocab)).astype(np.float32)


def _keys(rows: int, prompt_id: str = "p") -> jax.Array:
    base = jnp.asarray(np.stack([sample_base_key(7, prompt_id, 0)] * rows))  # u32[rows, 2]
    return position_keys(base, jnp.arange(rows, dtype=jnp.int32))


def _params(rows: int, temperature: float, top_k: int, top_p: float):
    return (jnp.full((rows,), temperature, jnp.float32), jnp.full((rows,), top_k, jnp.int32),
            jnp.full((rows,), top_p, jnp.float32))


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def test_greedy_is_argmax_with_raw_logprobs():
    logits = _logits(16)
    logits[3, [5, 9]] = logits[3].max() + 1.0  # a tie: the lowest index wins, like torch.argmax
    tokens, logprobs = sample(jnp.asarray(logits), *_params(16, 0.0, 0, 1.0), _keys(16))
    np.testing.assert_array_equal(np.asarray(tokens), logits.argmax(axis=-1))
    assert int(tokens[3]) == 5
    expected = np.take_along_axis(_log_softmax(logits), logits.argmax(axis=-1)[:, None], -1)[:, 0]
    np.testing.assert_allclose(np.asarray(logprobs), expected, atol=1e-6, rtol=0)


def test_sampled_logprobs_are_raw_log_softmax():
    logits = _logits(32)
    tokens, logprobs = sample(jnp.asarray(logits), *_params(32, 0.7, 10, 0.8), _keys(32))
    expected = np.take_along_axis(_log_softmax(logits), np.asarray(tokens)[:, None], -1)[:, 0]
    np.testing.assert_allclose(np.asarray(logprobs), expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize("temperature,top_k,top_p", SETTINGS)
def test_row_does_not_depend_on_its_batch(temperature, top_k, top_p):
    rows = 64
    logits = _logits(rows, seed=1)
    keys = _keys(rows)
    temps = np.random.default_rng(2).choice([0.0, 0.6, 1.0, 1.5], size=rows).astype(np.float32)
    ks = np.random.default_rng(3).choice([0, 1, 20, 50], size=rows).astype(np.int32)
    ps = np.random.default_rng(4).choice([0.5, 0.9, 1.0], size=rows).astype(np.float32)
    temps[0], ks[0], ps[0] = temperature, top_k, top_p  # row 0 is the row under test
    step = jax.jit(sample)

    alone = step(jnp.asarray(logits[:1]), jnp.asarray(temps[:1]), jnp.asarray(ks[:1]),
                 jnp.asarray(ps[:1]), keys[:1])
    perm = np.random.default_rng(5).permutation(rows)
    shuffled = step(jnp.asarray(logits[perm]), jnp.asarray(temps[perm]), jnp.asarray(ks[perm]),
                    jnp.asarray(ps[perm]), keys[perm])
    where = int(np.flatnonzero(perm == 0)[0])
    # Different padding: garbage rows with other settings and keys around the row under test.
    pad = _logits(8, seed=6)
    padded = step(jnp.asarray(np.concatenate([pad[:3], logits[:1], pad[3:]])),
                  jnp.asarray([0.0, 2.0, 0.3, temperature, 1.0, 0.0, 0.9, 0.1, 5.0], jnp.float32),
                  jnp.asarray([0, 3, 0, top_k, 0, 7, 1, 0, 2], jnp.int32),
                  jnp.asarray([1.0, 0.2, 1.0, top_p, 0.5, 1.0, 1.0, 0.9, 0.3], jnp.float32),
                  _keys(9, prompt_id="padding").at[3].set(keys[0]))
    for tokens, logprobs, i in ((shuffled[0], shuffled[1], where), (padded[0], padded[1], 3)):
        assert int(tokens[i]) == int(alone[0][0])
        assert float(logprobs[i]) == float(alone[1][0])


def _draw(logits_row: np.ndarray, draws: int, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    logits = jnp.asarray(np.broadcast_to(logits_row, (draws, logits_row.shape[-1])))
    tokens, _ = jax.jit(sample)(logits, *_params(draws, temperature, top_k, top_p), _keys(draws))
    return np.asarray(tokens)


def test_top_k_keeps_only_the_k_most_likely():
    row = _logits(1, seed=8)[0]
    tokens = _draw(row, 2000, 2.0, 5, 1.0)
    top5 = set(np.argsort(-row)[:5].tolist())
    assert set(tokens.tolist()) == top5  # all within, and (at temperature 2) every one is reached


def test_top_p_keeps_only_the_nucleus():
    row = _logits(1, seed=9)[0]
    temperature, top_p = 1.5, 0.6
    probs = np.exp(_log_softmax(row / temperature))
    order = np.argsort(-probs)
    mass_before = np.cumsum(probs[order]) - probs[order]
    nucleus = set(order[mass_before < top_p].tolist())
    tokens = _draw(row, 2000, temperature, 0, top_p)
    assert set(tokens.tolist()) <= nucleus
    assert len(set(tokens.tolist())) > 1


def test_top_p_boundary_keeps_the_token_that_reaches_the_mass():
    row = np.log(np.array([0.2, 0.5, 0.3], np.float32))
    # 0.5 < 0.7, so the nucleus needs the 0.3 token too; 0.2 is left out.
    tokens = _draw(row, 4000, 1.0, 0, 0.7)
    assert set(tokens.tolist()) == {1, 2}
    assert abs(np.mean(tokens == 1) - 0.5 / 0.8) < 0.03  # renormalised within the nucleus


def test_top_k_then_top_p_on_the_renormalised_distribution():
    row = _logits(1, seed=10)[0]
    temperature, top_k, top_p = 1.0, 8, 0.5
    top = np.argsort(-row)[:top_k]
    probs = np.exp(_log_softmax(row[top] / temperature))  # already sorted descending
    nucleus = set(top[(np.cumsum(probs) - probs) < top_p].tolist())
    assert set(_draw(row, 2000, temperature, top_k, top_p).tolist()) <= nucleus


def test_top_k_one_and_tiny_top_p_are_greedy():
    logits = _logits(64, seed=11)
    keys = _keys(64)
    greedy = logits.argmax(axis=-1)
    by_k, _ = sample(jnp.asarray(logits), *_params(64, 1.0, 1, 1.0), keys)
    by_p, _ = sample(jnp.asarray(logits), *_params(64, 1.0, 0, 1e-6), keys)
    np.testing.assert_array_equal(np.asarray(by_k), greedy)
    np.testing.assert_array_equal(np.asarray(by_p), greedy)


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_frequencies_match_the_tempered_softmax(temperature):
    row = np.array([1.0, 0.0, -0.5, 2.0, 0.3, -1.0], np.float32)
    draws = 20_000
    tokens = _draw(row, draws, temperature, 0, 1.0)
    expected = np.exp(_log_softmax(row / temperature))
    observed = np.bincount(tokens, minlength=row.size) / draws
    # Largest standard error here is about 0.0035, so 0.02 is more than 5 sigma.
    assert np.abs(observed - expected).max() < 0.02


def test_mixed_rows_under_jit():
    logits = _logits(4, seed=12)
    temps = jnp.asarray([0.0, 1.0, 0.7, 0.0], jnp.float32)
    ks = jnp.asarray([0, 1, 0, 3], jnp.int32)
    ps = jnp.asarray([1.0, 1.0, 1e-6, 0.5], jnp.float32)
    keys = _keys(4)
    eager = sample(jnp.asarray(logits), temps, ks, ps, keys)
    jitted = jax.jit(sample)(jnp.asarray(logits), temps, ks, ps, keys)
    # Rows 1 and 2 collapse to greedy through top_k=1 and a tiny top_p.
    np.testing.assert_array_equal(np.asarray(jitted[0]), logits.argmax(axis=-1))
    np.testing.assert_array_equal(np.asarray(jitted[0]), np.asarray(eager[0]))
    raw_keys = jax.random.key_data(keys)  # raw u32[S, 2] key data is accepted too
    np.testing.assert_array_equal(np.asarray(jax.jit(sample)(jnp.asarray(logits), temps, ks, ps,
                                                            raw_keys)[0]), np.asarray(eager[0]))


def test_base_key_derivation_is_pinned():
    message = b"pagefleet.sample_key.v1\x0042\x003\x00prompt-\xc3\xa9"
    digest = hashlib.blake2b(message, digest_size=8).digest()
    expected = np.frombuffer(digest, "<u4")
    base = sample_base_key(42, "prompt-é", 3)
    assert base.dtype == np.uint32 and base.shape == (2,)
    np.testing.assert_array_equal(base, expected)


def test_keys_are_deterministic_and_distinct():
    def data(*identity) -> tuple[int, ...]:
        return tuple(np.asarray(jax.random.key_data(sample_key(*identity))).tolist())

    reference = data(0, "a", 0, 10)
    assert reference == data(0, "a", 0, 10)
    variants = [(1, "a", 0, 10), (0, "b", 0, 10), (0, "a", 1, 10), (0, "a", 0, 11), (0, "a0", 0, 10)]
    keys = {data(*v) for v in variants} | {reference}
    assert len(keys) == len(variants) + 1
    # Prompt ids and generation indices are not confused with each other (an unambiguous encoding).
    assert not np.array_equal(sample_base_key(0, "1", 23), sample_base_key(0, "31", 2))


def test_position_keys_depend_only_on_their_row():
    bases = np.stack([sample_base_key(0, f"p{i}", i % 3) for i in range(5)])  # u32[5, 2]
    positions = np.array([4, 17, 0, 9, 33], np.int32)
    batch = np.asarray(jax.random.key_data(jax.jit(position_keys)(jnp.asarray(bases),
                                                                  jnp.asarray(positions))))
    for i in range(5):
        alone = np.asarray(jax.random.key_data(sample_key(0, f"p{i}", i % 3, int(positions[i]))))
        np.testing.assert_array_equal(batch[i], alone)


def test_fast_paths_do_not_change_a_rows_token():
    """All-greedy and no-truncation batches skip work; a row's token must not depend on which path ran."""
    rng = np.random.default_rng(123)
    logits = jnp.asarray(rng.standard_normal((6, 300)).astype(np.float32) * 3)
    keys = jnp.asarray(np.stack([sample_base_key(0, f"p{i}", 0) for i in range(6)]))
    plain = dict(temperature=jnp.full(6, 0.9), top_k=jnp.zeros(6, jnp.int32), top_p=jnp.ones(6))
    alone, _ = jax.jit(sample)(logits, plain["temperature"], plain["top_k"], plain["top_p"], keys)  # no sort
    top_k = plain["top_k"].at[5].set(20)  # one row truncates: the batch takes the sorting path
    mixed, _ = jax.jit(sample)(logits, plain["temperature"], top_k, plain["top_p"], keys)
    np.testing.assert_array_equal(np.asarray(mixed)[:5], np.asarray(alone)[:5])
    greedy_t = plain["temperature"].at[:].set(0.0)
    all_greedy, _ = jax.jit(sample)(logits, greedy_t, top_k, plain["top_p"], keys)  # skips sampling
    one_sampled, _ = jax.jit(sample)(logits, greedy_t.at[0].set(0.9), top_k, plain["top_p"], keys)
    np.testing.assert_array_equal(np.asarray(all_greedy)[1:], np.asarray(one_sampled)[1:])
    np.testing.assert_array_equal(np.asarray(all_greedy), np.argmax(np.asarray(logits), axis=-1))


def test_greedy_program_gives_what_sample_gives_greedy_rows():
    """An all-greedy step runs `greedy_sample` (no sampling in its program); a greedy row must get the same
    token and the same logprob bits as from `sample`, alone or among sampled rows."""
    logits = _logits(8, vocab=300, seed=5) * 2
    logits[2, [7, 40]] = logits[2].max() + 0.5  # a tie
    keys = jnp.asarray(np.stack([sample_base_key(0, f"p{i}", 0) for i in range(8)]))
    greedy_tokens, greedy_logprobs = jax.jit(greedy_sample)(jnp.asarray(logits))
    temperature = jnp.zeros(8).at[1].set(0.9).at[6].set(1.2)  # rows 1 and 6 sample, the rest are greedy
    for t in (jnp.zeros(8), temperature):
        tokens, logprobs = jax.jit(sample)(jnp.asarray(logits), t, jnp.full(8, 20, jnp.int32), jnp.full(8, 0.9), keys)
        greedy = np.asarray(t) == 0
        np.testing.assert_array_equal(np.asarray(tokens)[greedy], np.asarray(greedy_tokens)[greedy])
        np.testing.assert_array_equal(np.asarray(logprobs)[greedy], np.asarray(greedy_logprobs)[greedy])
    assert int(greedy_tokens[2]) == 7


def test_program_without_truncation_gives_the_same_samples():
    """A step whose sampled rows all have top_k and top_p off runs `sample(truncation=False)` (no sort)."""
    logits = jnp.asarray(_logits(8, vocab=300, seed=6))
    keys = jnp.asarray(np.stack([sample_base_key(1, f"p{i}", 0) for i in range(8)]))
    temperature = jnp.full(8, 0.8).at[3].set(0.0)  # one greedy row among them
    off = (jnp.zeros(8, jnp.int32), jnp.ones(8))
    full = jax.jit(sample)(logits, temperature, *off, keys)
    lean = jax.jit(lambda *a: sample(*a, truncation=False))(logits, temperature, *off, keys)
    for a, b in zip(full, lean):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
