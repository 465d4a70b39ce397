"""The paged engine against Hugging Face transformers (CPU torch, float32)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import transformers

from engine.config import EngineConfig
from engine.models.presets import write_model
from engine.models.checkpoint_check import check_checkpoint
from engine.models.model_config import ModelConfig, UnsupportedModelError
from engine.kv.kv_cache_manager import KVCacheManager
from engine.device.runner import ModelRunner, SeqChunk
from engine.device.runner_config import RunnerConfig
from engine.models.weights import load_transformer
from tests.engine.models.hf_reference import FAMILIES, hf_greedy, make_hf_model

PROMPT_LENS = [1, 7, 16, 17, 45, 100, 230, 300]
NEW_TOKENS = 48
PAGE_SIZE = 16
LOGIT_ATOL = 1e-4
MIN_GAP = 1e-3
# Seeds are chosen so that no greedy step of the test is a near-tie (the test asserts it; see MIN_GAP).
MODEL_SEEDS = {"tiny-llama": 0, "tiny-mistral": 3, "tiny-qwen2": 0, "tiny-qwen3": 0, "tiny-gemma2": 0, "tiny-gemma3": 0}  # ten times the logit tolerance: a pass is equality, not luck


class PagedSequences:
    """Minimal driver: prompts prefilled in chunks across steps, pages handed out interleaved."""

    def __init__(self, runner: ModelRunner, prompts: list[list[int]]):
        self.runner = runner
        self.tokens = [list(p) for p in prompts]
        self.pages: list[list[int]] = [[] for _ in prompts]
        self.cached = [0] * len(prompts)
        # This driver plays the scheduler: it hands out the KV cache manager's pages itself.
        self.allocator = KVCacheManager(runner.config.kv).allocator

    def _reserve(self, total_tokens: list[int]) -> None:
        # One page at a time, round robin: every sequence's pages are scattered through the pool.
        alloc = self.allocator
        ps = self.runner.config.page_size
        while any(len(p) * ps < n for p, n in zip(self.pages, total_tokens)):
            for p, n in zip(self.pages, total_tokens):
                if len(p) * ps < n:
                    p.extend(alloc.allocate(1))

    def prefill(self, chunk_tokens: int, step_tokens: int) -> np.ndarray:
        self._reserve([len(t) for t in self.tokens])
        logits = [None] * len(self.tokens)
        while any(c < len(t) for c, t in zip(self.cached, self.tokens)):
            chunks, owners, budget = [], [], step_tokens
            for s, t in enumerate(self.tokens):
                n = min(chunk_tokens, len(t) - self.cached[s], budget)
                if n > 0:
                    chunks.append(SeqChunk(t[self.cached[s]:self.cached[s] + n], self.cached[s], self.pages[s]))
                    owners.append(s)
                    budget -= n
            for s, row in zip(owners, self.runner.logits(chunks)):
                self.cached[s] += len(chunks[owners.index(s)].token_ids)
                logits[s] = row
        return np.stack(logits)

    def greedy(self, first_logits: np.ndarray, steps: int) -> list[list[int]]:
        out = [[int(np.argmax(row))] for row in first_logits]
        for _ in range(steps - 1):
            for s, o in enumerate(out):
                self.tokens[s].append(o[-1])
            self._reserve([len(t) for t in self.tokens])
            chunks = [SeqChunk([t[-1]], len(t) - 1, p) for t, p in zip(self.tokens, self.pages)]
            for o, row in zip(out, self.runner.logits(chunks)):
                o.append(int(np.argmax(row)))
        return out


def make_prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, n).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module", params=list(MODEL_SEEDS))
def family(request, tmp_path_factory):
    """A preset written by `init-model`'s code, and transformers' model loaded from the same directory."""
    path = write_model(request.param, tmp_path_factory.mktemp(request.param), seed=MODEL_SEEDS[request.param])
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return request.param, path, hf


def test_logits_and_greedy_match_transformers(family):
    name, path, hf = family
    model = load_transformer(path)
    engine = EngineConfig(page_size=PAGE_SIZE, max_pages=256, max_seqs=8, max_prefill_size=256,
                          attn_pages_per_block=4, attn_queries_per_block=16)
    runner = ModelRunner(model, RunnerConfig.of(engine), max_seq_len=512)
    prompts = make_prompts(model.config.vocab_size)
    seqs = PagedSequences(runner, prompts)
    # Prefill in chunks of up to 64 tokens, at most 160 tokens a step: long prompts span several steps.
    logits = seqs.prefill(chunk_tokens=64, step_tokens=160)
    for s, prompt in enumerate(prompts):
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0, -1].numpy()
        np.testing.assert_allclose(logits[s], ref, atol=LOGIT_ATOL, rtol=0, err_msg=f"{name} prompt {s}")
    # Pages are scattered: no sequence of >1 page holds a contiguous run.
    assert any(np.any(np.diff(p) != 1) for p in seqs.pages if len(p) > 1)

    generated = seqs.greedy(logits, NEW_TOKENS)
    for s, prompt in enumerate(prompts):
        ref_tokens, gap = hf_greedy(hf, prompt, NEW_TOKENS)
        assert gap > MIN_GAP, f"{name} prompt {s}: top-2 logit gap {gap} is too small for the test to mean anything"
        assert generated[s] == ref_tokens, f"{name} prompt {s} (len {len(prompt)})"
    seqs.allocator.check(seqs.pages)


@pytest.mark.parametrize("family_name", list(FAMILIES))
def test_loads_checkpoints_written_by_save_pretrained(tmp_path, family_name):
    """transformers' own writer, one file and sharded (model.safetensors.index.json), not only ours."""
    shard = "60KB" if family_name == "mistral" else None
    hf = make_hf_model(family_name, tmp_path, max_shard_size=shard)
    assert (tmp_path / "model.safetensors.index.json").exists() == (shard is not None)
    runner = ModelRunner(load_transformer(tmp_path), RunnerConfig.of(EngineConfig(page_size=4, max_pages=200)),
                         max_seq_len=512)
    prompts = make_prompts(256, seed=2)[:5]
    logits = PagedSequences(runner, prompts).prefill(chunk_tokens=40, step_tokens=100)
    for s, prompt in enumerate(prompts):
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0, -1].numpy()
        np.testing.assert_allclose(logits[s], ref, atol=LOGIT_ATOL, rtol=0, err_msg=f"{family_name} prompt {s}")


@pytest.mark.parametrize("model_axis", [2, 4])
def test_tensor_parallel_equals_single_device(tmp_path, model_axis):
    import jax
    from jax.sharding import Mesh

    make_hf_model("llama3", tmp_path, heads=8, kv_heads=4, head_dim=8, intermediate=96)
    devices = np.array(jax.devices()[:4]).reshape(4 // model_axis, model_axis)
    mesh = Mesh(devices, ("data", "model"))
    engine = EngineConfig(page_size=8, max_pages=128, max_prefill_size=256)
    prompts = make_prompts(256, seed=1)[:6]
    results = []
    for m in (None, mesh):
        runner = ModelRunner(load_transformer(tmp_path, mesh=m), RunnerConfig.of(engine), max_seq_len=512, mesh=m)
        seqs = PagedSequences(runner, prompts)
        logits = seqs.prefill(chunk_tokens=48, step_tokens=128)
        results.append((logits, seqs.greedy(logits, 12)))
    # Weights really are split over the `model` axis (wq: [layers, embed, kv_heads, q_per_kv, head_size]).
    sharded = load_transformer(tmp_path, mesh=mesh)
    assert sharded.layers.attn.wq.array.addressable_shards[0].data.shape[2] == 4 // model_axis
    # End-to-end tolerance: sharded contractions (o_proj, down_proj) all-reduce partial sums in another order.
    np.testing.assert_allclose(results[1][0], results[0][0], atol=LOGIT_ATOL, rtol=0)
    assert results[1][1] == results[0][1]


def test_unsupported_configs_name_the_field(tmp_path):
    base = json.loads(json.dumps({"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 8,
                                  "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1}))
    assert ModelConfig.from_hf(base).head_dim == 4
    with pytest.raises(UnsupportedModelError, match="model_type='gpt2'"):
        ModelConfig.from_hf({**base, "model_type": "gpt2"})
    with pytest.raises(UnsupportedModelError, match="rope_type='yarn'"):
        ModelConfig.from_hf({**base, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(UnsupportedModelError, match="hidden_act"):
        ModelConfig.from_hf({**base, "hidden_act": "gelu"})
    with pytest.raises(UnsupportedModelError, match="num_key_value_heads=3"):
        ModelConfig.from_hf({**base, "num_key_value_heads": 3})
    # A config.json without the fields a decoder needs is named in one line, not a KeyError.
    with pytest.raises(UnsupportedModelError, match="config.json has no num_attention_heads, num_hidden_layers"):
        ModelConfig.from_hf({k: v for k, v in base.items() if k not in ("num_attention_heads", "num_hidden_layers")})


@pytest.mark.parametrize("field, value", [("num_hidden_layers", 1e9), ("num_hidden_layers", 10**9),
                                          ("num_attention_heads", 0), ("num_key_value_heads", -2),
                                          ("vocab_size", "512"), ("hidden_size", True), ("intermediate_size", 2.5),
                                          ("max_position_embeddings", -1), ("rope_theta", float("nan")),
                                          ("rms_norm_eps", 0)])
def test_config_sizes_are_bounded_before_anything_is_sized_from_them(tmp_path, field, value):
    """A size that no model has (a typo, a hostile file) is one line naming the field, before shapes, pools or
    rotary tables are built from it: 1e9 layers made the checkpoint check build a billion layers' shapes."""
    base = {"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 8,
            "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1}
    with pytest.raises(UnsupportedModelError, match=f"config.json {field}="):
        ModelConfig.from_hf({**base, field: value})
    (tmp_path / "config.json").write_text(json.dumps({**base, field: value}))
    with pytest.raises(UnsupportedModelError, match=f"config.json {field}="):
        check_checkpoint(tmp_path)


def test_released_checkpoint_rope_fields_are_read():
    """Released Llama 3.1 configs carry top-level rope_theta and rope_scaling (transformers 5 writes rope_parameters)."""
    cfg = ModelConfig.from_hf({
        "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "rope_theta": 500000.0,
        "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "max_position_embeddings": 131072, "eos_token_id": [128001, 128008, 128009]})
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling.factor == 8.0
    assert cfg.eos_token_ids == (128001, 128008, 128009)
    inv = cfg.rope_inv_freq()
    assert math.isclose(inv[0], 1.0) and inv[-1] < 1.0 / 500000.0 ** ((cfg.head_dim - 2) / cfg.head_dim)


def test_bfloat16_computes_the_same_model(tmp_path):
    """bf16 weights and KV pool: logits within bf16 precision of float32, same argmax where the margin is clear."""
    import jax.numpy as jnp

    path = write_model("tiny-llama", tmp_path)
    prompts = make_prompts(512, seed=3)
    engine = EngineConfig(page_size=16, max_pages=128, max_prefill_size=256)
    out = {}
    for dtype in (jnp.float32, jnp.bfloat16):
        model = load_transformer(path, dtype=dtype)
        assert model.layers.attn.wq.array.dtype == dtype
        runner = ModelRunner(model, RunnerConfig.of(engine), max_seq_len=512, kv_dtype=dtype)
        assert runner.kv.pool.array.dtype == dtype
        out[dtype] = PagedSequences(runner, prompts).prefill(chunk_tokens=64, step_tokens=160)
    f32, bf16 = out[jnp.float32], out[jnp.bfloat16]
    scale = np.abs(f32).max()
    assert np.abs(bf16 - f32).max() < 0.05 * scale  # bf16 keeps ~3 significant digits through 2 layers
    assert np.abs(bf16 - f32).max() > 0  # it really ran in bfloat16
    top2 = np.sort(f32, axis=-1)[:, -2:]
    row_error = np.abs(bf16 - f32).max(axis=-1)
    clear = (top2[:, 1] - top2[:, 0]) > 2 * row_error  # where bf16 error cannot flip the argmax
    assert clear.sum() >= 2
    assert np.array_equal(f32.argmax(-1)[clear], bf16.argmax(-1)[clear])
