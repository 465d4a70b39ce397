"""Qwen3 against transformers' Qwen3ForCausalLM (CPU torch, float32): `pagefleet generate` end to end, the QK-norm
module, tensor parallelism, and the config.json fields it refuses. The bit-identity tests (batching, prefix cache,
recompute and swap preemption) run for tiny-qwen3 in tests/engine/test_engine.py and test_engine_swap.py."""

from __future__ import annotations

import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from jax.sharding import Mesh

from engine.config import EngineConfig, SamplingConfig
from engine.engine import Engine
from engine.models.axes import HEAD_SIZE
from engine.models.model import rms_norm
from engine.models.model_config import ModelConfig, UnsupportedModelError
from engine.scheduling.sequence import Request
from tests.engine.models.hf_reference import generate_records, hf_greedy_logprobs, make_hf_model, prompts_1_to_250

VOCAB = 512
MIN_GAP = 1e-3


def test_generate_greedy_tokens_and_logprobs_equal_transformers(tmp_path):
    """16 prompts of 1 to 250 tokens through `pagefleet generate`, 40 new tokens each, 6 at once in 60 pages of 16
    (preemption asserted), head_dim 32 with 4 heads of a 64-wide model: transformers' greedy tokens (batch 1), and
    logprobs within 1e-4."""
    new_tokens = 40
    hf = make_hf_model("qwen3", tmp_path / "model", vocab=VOCAB, seed=0)
    assert hf.config.head_dim * hf.config.num_attention_heads != hf.config.hidden_size
    prompts = prompts_1_to_250(16, seed=1, vocab=VOCAB)
    records = generate_records(tmp_path / "model", tmp_path, prompts, new_tokens)
    for i, (p, r) in enumerate(zip(prompts, records)):
        tokens, logprobs, gap = hf_greedy_logprobs(hf, p, new_tokens)
        assert gap > MIN_GAP, f"prompt {i}: top-2 gap {gap} too small for the comparison to mean anything"
        assert r["finish_reason"] == "length" and r["token_ids"] == tokens, f"prompt {i} (len {len(p)})"
        np.testing.assert_allclose(r["logprobs"], logprobs, atol=1e-4, rtol=0, err_msg=f"prompt {i}")


def test_qk_norm_equals_transformers():
    """The RMSNorm over each head (Qwen3RMSNorm on q and k before RoPE), in float32: 1e-5."""
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((5, 2, 3, 32)) * 3).astype(np.float32)  # [token, kv_heads, q_per_kv, head_size]
    w = (1 + 0.1 * rng.standard_normal(32)).astype(np.float32)
    norm = transformers.models.qwen3.modeling_qwen3.Qwen3RMSNorm(32, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.tensor(w))
        ref = norm(torch.tensor(x)).numpy()
    axes = (hax.Axis("token", 5), hax.Axis("kv_heads", 2), hax.Axis("q_per_kv", 3), hax.Axis(HEAD_SIZE, 32))
    got = rms_norm(hax.named(jnp.asarray(x), axes), hax.named(jnp.asarray(w), (axes[-1],)), 1e-6, HEAD_SIZE)
    np.testing.assert_allclose(np.asarray(got.array), ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("width", [2, 4])
def test_tensor_parallel_samples_as_one_device(tmp_path, width):
    """At `model: 2` (the 2 KV heads split) and `model: 4` (each KV head replicated twice): one device's tokens,
    logprobs within 1e-4 (sharded contractions sum partial products in another order)."""
    make_hf_model("qwen3", tmp_path, vocab=VOCAB, seed=0)
    rng = np.random.default_rng(3)
    requests = [Request(f"r{i}", tuple(rng.integers(6, VOCAB, int(n)).tolist()),
                        SamplingConfig(max_new_tokens=12, temperature=t, seed=2, logprobs=True))
                for i, (n, t) in enumerate([(5, 0.0), (40, 0.0), (90, 0.8), (17, 0.8)])]
    config = EngineConfig(page_size=8, max_pages=96, max_seqs=4, max_seq_len=160)
    one = Engine(tmp_path, config).generate(requests)
    mesh = Mesh(np.array(jax.devices()[:width]).reshape(1, width), ("data", "model"))
    engine = Engine(tmp_path, config, mesh=mesh)
    got = engine.generate(requests)
    # Each device holds K and V of one KV head: its own of the two, or one of four copies.
    assert {s.data.shape[2] for s in engine.runner.kv.pool.array.addressable_shards} == {2}
    assert [c.token_ids for c in got] == [c.token_ids for c in one]
    for a, b in zip(got, one):
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4, rtol=0)


BASE = {"model_type": "qwen3", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16}


def test_config_reads_head_dim_and_qk_norm_and_refuses_sliding_windows():
    cfg = ModelConfig.from_hf(BASE)
    assert (cfg.head_dim, cfg.qk_norm, cfg.qkv_bias, cfg.sliding_window) == (16, True, False, None)
    assert ModelConfig.from_hf({**BASE, "attention_bias": True}).qkv_bias
    assert ModelConfig.from_hf({**BASE, "use_sliding_window": False, "sliding_window": 4,
                                "layer_types": ["full_attention"] * 2}).sliding_window is None
    with pytest.raises(UnsupportedModelError, match=r"^config.json use_sliding_window=true .*model_type=qwen3; set it to false$"):
        ModelConfig.from_hf({**BASE, "use_sliding_window": True, "sliding_window": 4})
    with pytest.raises(UnsupportedModelError, match=r"^config.json layer_types holds \['sliding_attention'\]"):
        ModelConfig.from_hf({**BASE, "layer_types": ["full_attention", "sliding_attention"]})
