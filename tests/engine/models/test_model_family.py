"""The model families: one file each, registered by config.json's model_type, each reading its own knobs."""

import pytest

from engine.models.model_config import SUPPORTED_MODEL_TYPES, ModelConfig, UnsupportedModelError
from engine.models.model_registry import FAMILIES, model_family
from engine.models.presets import PRESETS

BASE = {"vocab_size": 10, "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 2,
        "num_attention_heads": 2, "sliding_window": 4}


def test_every_family_is_registered_by_its_model_type_and_names_its_architecture():
    assert SUPPORTED_MODEL_TYPES == ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "gemma3", "mixtral",
                                     "qwen3_moe", "qwen2_moe") == tuple(FAMILIES)
    for model_type, family in FAMILIES.items():
        assert family.model_type == model_type
        assert family.architecture.endswith("ForCausalLM") or family.architecture == "Gemma3ForConditionalGeneration"
    assert model_family("gpt2") is None and model_family(None) is None
    # Every preset is of a registered family and writes its architecture.
    assert {p.family for p in PRESETS.values()} <= set(FAMILIES)


@pytest.mark.parametrize("model_type, extra, bias, window", [
    ("llama", {}, False, None),  # a sliding_window key means nothing to Llama
    ("llama", {"attention_bias": True}, True, None),
    ("mistral", {}, False, 4),
    ("qwen2", {}, True, None),  # Qwen2's window needs use_sliding_window
    ("qwen2", {"use_sliding_window": True}, True, 4),
    ("qwen2_moe", {}, True, None),  # Qwen2's attention; its biases follow qkv_bias
    ("qwen2_moe", {"qkv_bias": False}, False, None),
])
def test_each_family_sets_the_shared_attention_as_its_config_says(model_type, extra, bias, window):
    cfg = ModelConfig.from_hf({**BASE, "model_type": model_type, **extra})
    assert (cfg.model_type, cfg.qkv_bias, cfg.sliding_window) == (model_type, bias, window)


def test_a_family_refusal_is_an_unsupported_model_error_naming_the_field():
    with pytest.raises(UnsupportedModelError, match="max_window_layers"):
        ModelConfig.from_hf({**BASE, "model_type": "qwen2", "use_sliding_window": True, "max_window_layers": 1})
