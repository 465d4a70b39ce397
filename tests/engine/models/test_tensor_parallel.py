"""Tensor parallel beyond the KV heads: a one-KV-head model at `model: 2` and `model: 4` (each KV head replicated
on every device, as vLLM does) samples the same tokens as one device; widths that cannot work are refused by name."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from engine import ModelConfig, kv_replicas, sharded_config, tensor_parallel_error
from engine.engine import Engine
from engine.models.presets import PRESETS, write_model
from engine.models.tensor_parallel import MeshError, valid_widths
from engine.models.weights import load_transformer
from tests.engine.multihost_worker import engine_config, requests

LOGPROB_ATOL = 1e-4  # sharded contractions (o_proj, down_proj) sum partial products in another order


def _mesh(width: int) -> Mesh:
    return Mesh(np.array(jax.devices()[:width]).reshape(1, width), ("data", "model"))


@pytest.fixture(scope="module")
def one_kv_head(tmp_path_factory):
    """tiny-mistral: 4 attention heads sharing one KV head (multi-query attention)."""
    assert PRESETS["tiny-mistral"].num_key_value_heads == 1
    path = write_model("tiny-mistral", tmp_path_factory.mktemp("mqa") / "model")
    engine = Engine(path, engine_config())
    reference = engine.generate(requests(engine.model_config.vocab_size))
    return path, reference


@pytest.mark.parametrize("width", [2, 4])
def test_one_kv_head_beyond_its_kv_heads_samples_as_one_device(one_kv_head, width):
    path, reference = one_kv_head
    engine = Engine(path, engine_config(), mesh=_mesh(width))
    got = engine.generate(requests(engine.model_config.vocab_size))
    # The KV pool holds `width` copies of the one KV head, one per device (K and V of one head each).
    pool = engine.runner.kv.pool.array
    assert pool.shape[2] == 2 * width and {s.data.shape[2] for s in pool.addressable_shards} == {2}
    assert engine.model_config.num_kv_heads == 1  # the checkpoint's config is untouched
    assert [c.token_ids for c in got] == [c.token_ids for c in reference]
    for a, b in zip(got, reference):
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=LOGPROB_ATOL, rtol=0)
    seeded = [c.token_ids for c in got][6:]
    assert any(seeded[i] != seeded[i + 1] for i in range(0, len(seeded), 2)), "samples of a prompt all equal"


def test_replicated_kv_weights_are_copies_of_the_checkpoints(one_kv_head):
    path, _ = one_kv_head
    one = load_transformer(path)
    four = load_transformer(path, mesh=_mesh(4))
    assert four.config.num_kv_heads == 4 and four.config.q_per_kv == 1
    wk1, wk4 = np.asarray(one.layers.attn.wk.array), np.asarray(four.layers.attn.wk.array)  # [L, E, KV, D]
    for copy in range(4):
        np.testing.assert_array_equal(wk4[:, :, copy], wk1[:, :, 0])
    # Query heads keep their order: head h of the checkpoint is (KV head h // q_per_kv', its g) on the mesh.
    wq1 = np.asarray(one.layers.attn.wq.array)
    np.testing.assert_array_equal(np.asarray(four.layers.attn.wq.array).reshape(wq1.shape), wq1)


def _cfg(heads: int, kv: int, mlp: int = 128) -> ModelConfig:
    hf = {"model_type": "llama", "vocab_size": 16, "hidden_size": 8 * heads, "intermediate_size": mlp,
          "num_hidden_layers": 1, "num_attention_heads": heads, "num_key_value_heads": kv}
    return ModelConfig.from_hf(hf)


def test_widths_the_rule_allows_and_refuses():
    qwen_7b = _cfg(28, 4, 18944)  # Qwen2.5-7B: 28 heads, 4 KV heads
    assert valid_widths(qwen_7b) == [1, 2, 4]  # 28 would divide the heads, not the MLP width 18944
    assert tensor_parallel_error(qwen_7b, 4) is None and kv_replicas(qwen_7b, 4) == 1
    assert "cannot be split over 8 devices" in tensor_parallel_error(qwen_7b, 8)  # 8 does not divide 28 heads
    mqa = _cfg(8, 1)
    assert kv_replicas(mqa, 8) == 8 and sharded_config(mqa, 8).num_kv_heads == 8
    assert sharded_config(mqa, 1) is mqa
    assert "MLP width 100" in tensor_parallel_error(_cfg(8, 8, 100), 8)
    with pytest.raises(MeshError, match=r"cluster.mesh.model=3: .*one of \[1, 2, 4, 8\]"):
        kv_replicas(_cfg(8, 2), 3)


def test_a_mixture_of_experts_needs_a_width_that_divides_its_experts():
    """Experts are spread whole over `model` (expert parallelism): the width must divide the number of experts, not
    the expert MLP width. Qwen3-30B-A3B: 128 experts, 4 KV heads, 32 heads; Mixtral-8x7B: 8 experts, 8 KV heads."""
    from pathlib import Path

    configs = Path(__file__).resolve().parents[3] / "configs" / "models"
    qwen = ModelConfig.from_pretrained(configs / "qwen3-30b-a3b")
    mixtral = ModelConfig.from_pretrained(configs / "mixtral-8x7b")
    assert (qwen.moe.num_experts, mixtral.moe.num_experts) == (128, 8)
    assert valid_widths(qwen) == [1, 2, 4, 8, 16, 32] and valid_widths(mixtral) == [1, 2, 4, 8]
    hf = {"model_type": "mixtral", "vocab_size": 16, "hidden_size": 64, "intermediate_size": 96,
          "num_hidden_layers": 1, "num_attention_heads": 8, "num_key_value_heads": 8, "num_local_experts": 6,
          "num_experts_per_tok": 2}
    six = ModelConfig.from_hf(hf)  # expert MLP width 96 divides over 4; 6 experts do not
    assert "6 experts do not divide over 4 devices" in tensor_parallel_error(six, 4)
    assert tensor_parallel_error(six, 2) is None and valid_widths(six) == [1, 2]
