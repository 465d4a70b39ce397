"""engine/models/presets.py and engine/tokenizer/tokenizer_builder.py against transformers (the reference loader)."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import unicodedata

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from engine.models.presets import PRESETS, write_model
from engine.tokenizer.tokenizer_builder import SPECIAL_TOKENS

TINY = ["tiny-llama", "tiny-mistral", "tiny-qwen2", "tiny-qwen3", "tiny-mixtral", "tiny-qwen3-moe", "tiny-qwen2-moe",
        "tiny-gemma2", "tiny-gemma3"]
REPO_ROOT = pathlib.Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pathlib.Path]:
    root = tmp_path_factory.mktemp("presets")
    return {name: write_model(name, root / name, seed=0) for name in TINY}


@pytest.fixture(scope="module")
def tokenizers(written: dict[str, pathlib.Path]) -> dict:
    return {name: AutoTokenizer.from_pretrained(path) for name, path in written.items()}


def _load(path: pathlib.Path) -> torch.nn.Module:
    model, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set(), info
    assert info["mismatched_keys"] == set() and not info["error_msgs"], info
    return model.eval()


@pytest.mark.parametrize("name", TINY)
def test_transformers_loads_every_weight(name: str, written: dict[str, pathlib.Path]) -> None:
    preset = PRESETS[name]
    model = _load(written[name])
    assert type(model).__name__ == json.loads((written[name] / "config.json").read_text())["architectures"][0]
    assert sum(p.numel() for p in model.parameters()) == preset.num_parameters
    from engine.models.model_config import ModelConfig
    from engine.sizing.model_bytes import count_params

    assert count_params(ModelConfig.from_pretrained(written[name])).total == preset.num_parameters  # `pagefleet size`
    tied = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert tied == preset.tie_word_embeddings
    if preset.attention_bias:
        assert model.model.layers[0].self_attn.q_proj.bias is not None


@pytest.mark.parametrize("name", TINY)
def test_config_round_trips(name: str, written: dict[str, pathlib.Path]) -> None:
    preset = PRESETS[name]
    config = AutoConfig.from_pretrained(written[name])
    assert config.model_type == preset.family
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings",
                "rms_norm_eps", "tie_word_embeddings"):
        assert getattr(config, key) == getattr(preset, key), key
    assert config.num_key_value_heads < config.num_attention_heads
    if preset.gemma:  # the tanh GELU; windows and soft-caps as the preset says; Gemma 3: a RoPE per layer kind
        assert config.hidden_activation == "gelu_pytorch_tanh"
        assert config.layer_types == preset.layer_types() and config.sliding_window == preset.sliding_window
        assert config.attn_logit_softcapping == preset.attn_logit_softcap
        assert config.final_logit_softcapping == preset.final_logit_softcap
        rope = config.rope_parameters
        if preset.family == "gemma3_text":
            assert rope["sliding_attention"] == {"rope_type": "default", "rope_theta": preset.local_rope_theta}
            rope = rope["full_attention"]
    else:
        assert config.hidden_act == "silu"
        # transformers 5 folds rope_theta and rope_scaling into `rope_parameters` when loading.
        rope = config.rope_parameters
    assert rope["rope_theta"] == preset.rope_theta
    if preset.rope_scaling is None:
        assert rope.get("rope_type", "default") == "default"
    else:
        assert {k: rope[k] for k in preset.rope_scaling} == preset.rope_scaling
    if preset.family in ("qwen2", "qwen3", "qwen3_moe"):
        assert config.use_sliding_window is False
    if preset.family in ("mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe"):
        assert config.sliding_window is None


@pytest.mark.parametrize("name", TINY)
def test_tokenizer_matches_config(name: str, written: dict[str, pathlib.Path], tokenizers: dict) -> None:
    tokenizer = tokenizers[name]
    config = json.loads((written[name] / "config.json").read_text())
    generation = json.loads((written[name] / "generation_config.json").read_text())
    assert len(tokenizer) == config["vocab_size"] == PRESETS[name].vocab_size
    assert tokenizer.bos_token_id == config["bos_token_id"] == generation["bos_token_id"] == 0
    assert tokenizer.eos_token_id == config["eos_token_id"] == generation["eos_token_id"] == 1
    assert tokenizer.pad_token_id == tokenizer.eos_token_id
    assert tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS)) == list(range(len(SPECIAL_TOKENS)))
    assert set(tokenizer.all_special_ids) == set(range(len(SPECIAL_TOKENS)))
    # No automatic BOS: encoding gives the text's tokens only.
    ids = tokenizer("hello there")["input_ids"]
    assert ids and ids[0] != tokenizer.bos_token_id
    assert tokenizer("<|user|>hi<|end|>")["input_ids"][0] == tokenizer.convert_tokens_to_ids("<|user|>")


@pytest.mark.parametrize("name", TINY)
@settings(max_examples=60, deadline=None)
@given(text=st.text(max_size=60))
@example(text="\uf900")  # a CJK compatibility ideograph: NFC makes it U+8C48 (Qwen2-MoE's tokenizer once kept it)
def test_tokenizer_round_trips_text(name: str, tokenizers: dict, text: str) -> None:
    tokenizer = tokenizers[name]
    decoded = tokenizer.decode(tokenizer(text)["input_ids"])
    # Qwen's tokenizer always NFC-normalises (see engine/tokenizer/tokenizer_builder.py).
    expected = unicodedata.normalize("NFC", text) if name in ("tiny-qwen2", "tiny-qwen3", "tiny-qwen3-moe", "tiny-qwen2-moe") else text
    assert decoded == expected


@pytest.mark.parametrize("name", TINY)
def test_chat_template_renders(name: str, tokenizers: dict) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    text = tokenizers[name].apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|begin_of_text|><|system|>\nBe brief.<|end|>\n<|user|>\nHi!<|end|>\n<|assistant|>\n"
    without = tokenizers[name].apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert without == text.removesuffix("<|assistant|>\n")


def test_weights_are_deterministic_in_seed(tmp_path: pathlib.Path) -> None:
    a = write_model("tiny-qwen2", tmp_path / "a", seed=3)
    b = write_model("tiny-qwen2", tmp_path / "b", seed=3)
    c = write_model("tiny-qwen2", tmp_path / "c", seed=4)
    for file in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (a / file).read_bytes() == (b / file).read_bytes(), file
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_bytes() == (c / "tokenizer.json").read_bytes()


def test_unknown_preset_raises_with_choices(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ValueError, match="tiny-llama"):
        write_model("tiny-gpt", tmp_path)


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-m", "orchestrator", "init-model", *args],
                          capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=120)


def test_cli_writes_model(tmp_path: pathlib.Path) -> None:
    result = _cli("--preset", "tiny-llama", "--output", str(tmp_path / "m"))
    assert result.returncode == 0, result.stderr
    names = {p.name for p in (tmp_path / "m").iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "special_tokens_map.json", "generation_config.json"} <= names


def test_cli_rejects_unknown_preset(tmp_path: pathlib.Path) -> None:
    result = _cli("--preset", "tiny-gpt", "--output", str(tmp_path / "m"))
    assert result.returncode != 0
    assert all(name in result.stderr for name in PRESETS), result.stderr
    assert not (tmp_path / "m").exists()


def test_tiny_llama_logit_gaps_dwarf_float32_rounding(written: dict[str, pathlib.Path], tokenizers: dict) -> None:
    """The init scale makes greedy decoding robust: top-1 vs top-2 gaps far above 1e-3."""
    model, tokenizer = _load(written["tiny-llama"]), tokenizers["tiny-llama"]
    prompts = ["Hello there, friend.", "def foo(x):\n    return x + 1", "The 42 stars shine", "a b c d e f g"]
    gaps = []
    with torch.no_grad():
        for prompt in prompts:
            logits = model(torch.tensor([tokenizer(prompt)["input_ids"]])).logits[0]  # f32[seq, vocab]
            top2 = torch.topk(logits, 2, dim=-1).values
            gaps.extend((top2[:, 0] - top2[:, 1]).tolist())
            assert logits.std() > 2.0
    gaps = np.array(gaps)
    assert np.mean(gaps > 1e-3) > 0.95, gaps
    assert np.median(gaps) > 0.1, gaps


def test_llama_40m_size(tmp_path: pathlib.Path) -> None:
    preset = PRESETS["llama-40m"]
    print(f"llama-40m: {preset.num_parameters:,} parameters")
    assert 35e6 < preset.num_parameters < 45e6
    weights = preset.init_weights(seed=0)
    assert sum(w.size for w in weights.values()) == preset.num_parameters
    assert all(w.dtype == np.float32 for w in weights.values())


@pytest.mark.slow
def test_llama_40m_loads_in_transformers(tmp_path: pathlib.Path) -> None:
    path = write_model("llama-40m", tmp_path / "m")
    model = _load(path)
    assert sum(p.numel() for p in model.parameters()) == PRESETS["llama-40m"].num_parameters
    assert len(AutoTokenizer.from_pretrained(path)) == 8192


def test_write_model_takes_a_preset_of_its_own_shape(tmp_path):
    """A `Preset` that is not built in (a benchmark's own shape) writes the same files as a named one."""
    from engine import Preset

    shape = dataclasses.replace(PRESETS["tiny-llama"], num_hidden_layers=3)
    out = write_model(shape, tmp_path / "own", seed=0)
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 3
    assert isinstance(shape, Preset)
    same = write_model(PRESETS["tiny-llama"], tmp_path / "object", seed=0)
    named = write_model("tiny-llama", tmp_path / "named", seed=0)
    assert (same / "model.safetensors").read_bytes() == (named / "model.safetensors").read_bytes()
