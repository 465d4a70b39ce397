"""Gemma 2 (`model_type: gemma2`), Gemma 3's text model (`gemma3_text`) and the text model of Gemma 3's multimodal
checkpoints (`gemma3`). No JAX here; the layer is engine/models/gemma_model.py.

What Gemma needs beyond a Llama decoder (`LayerStyle`), all read from config.json:
- Gemma's layer: RMSNorm as (1 + weight), four norms per layer, embeddings scaled by sqrt(hidden_size), and a
  GeGLU MLP with the tanh GELU (`hidden_activation`);
- scores scaled by `query_pre_attn_scalar ** -0.5`, attention logit soft-capping (`attn_logit_softcapping`,
  Gemma 2) and final logit soft-capping (`final_logit_softcapping`);
- each layer full or sliding-window attention (`layer_types`; older configs: every other layer for Gemma 2,
  `sliding_window_pattern` for Gemma 3);
- Gemma 3: QK-norm and a RoPE per layer kind: `rope_local_base_freq` unscaled on sliding layers, `rope_theta` with
  its (linear) scaling on full ones. transformers 5 writes these as `rope_parameters` per layer type; released
  configs as `rope_theta`, `rope_scaling` and `rope_local_base_freq`. Both are read.

Released configs leave fields at transformers' defaults out (Gemma-3-27B's text_config has no `vocab_size`), so
each family fills in its config class's defaults first.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from engine.models.model_family import LAYER_TYPES, FamilyAttention, FamilyConfigError, LayerStyle, ModelFamily

GELU_TANH = "gelu_pytorch_tanh"

# transformers' Gemma2Config and Gemma3TextConfig defaults for the fields the engine reads.
_COMMON_DEFAULTS = {"hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26, "num_attention_heads": 8,
                    "num_key_value_heads": 4, "head_dim": 256, "hidden_activation": GELU_TANH, "rms_norm_eps": 1e-6,
                    "eos_token_id": 1, "bos_token_id": 2, "tie_word_embeddings": True, "attention_bias": False,
                    "query_pre_attn_scalar": 256, "sliding_window": 4096}
GEMMA2_DEFAULTS = {**_COMMON_DEFAULTS, "vocab_size": 256000, "max_position_embeddings": 8192, "rope_theta": 10000.0,
                   "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0}
GEMMA3_DEFAULTS = {**_COMMON_DEFAULTS, "vocab_size": 262208, "max_position_embeddings": 131072,
                   "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "final_logit_softcapping": None,
                   "attn_logit_softcapping": None, "sliding_window_pattern": 6}


def _positive(hf: dict, key: str) -> float | None:
    value = hf.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise FamilyConfigError(f"config.json {key}={value!r}: must be a positive number or null")
    return float(value)


def _layer_types(hf: dict, pattern: int) -> tuple[str, ...]:
    """config.json's `layer_types`, else transformers' default: every `pattern`-th layer full, the others sliding."""
    layers = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    if types is None:
        return tuple("sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers))
    if not isinstance(types, list) or len(types) != layers or any(t not in LAYER_TYPES for t in types):
        raise FamilyConfigError(f"config.json layer_types must list one of {', '.join(LAYER_TYPES)} for each of the "
                                f"{layers} layers (num_hidden_layers); got {types!r}")
    return tuple(types)


@dataclass(frozen=True)
class Gemma2(ModelFamily):
    defaults: tuple[tuple[str, object], ...] = tuple(GEMMA2_DEFAULTS.items())

    def text_config(self, hf: dict) -> dict:
        hf = {**dict(self.defaults), **hf}  # an explicit null stays null, as in transformers
        if hf.get("use_bidirectional_attention"):
            raise FamilyConfigError("config.json use_bidirectional_attention=true (an encoder) is not supported; "
                                    "pagefleet runs causal decoders")
        if hf.get("attention_bias"):
            raise FamilyConfigError("config.json attention_bias=true is not supported for Gemma (o_proj bias)")
        return hf

    def attention(self, hf: dict) -> FamilyAttention:
        window = hf.get("sliding_window")
        return FamilyAttention(qkv_bias=False, sliding_window=int(window) if window else None)

    def activation(self, hf: dict) -> str:
        return hf.get("hidden_activation") or GELU_TANH

    def style(self, hf: dict) -> LayerStyle:
        return LayerStyle(gemma_norms=True, query_pre_attn_scalar=_positive(hf, "query_pre_attn_scalar"),
                          attn_logit_softcap=_positive(hf, "attn_logit_softcapping"),
                          final_logit_softcap=_positive(hf, "final_logit_softcapping"),
                          layer_types=_layer_types(hf, 2))


@dataclass(frozen=True)
class Gemma3Text(Gemma2):
    defaults: tuple[tuple[str, object], ...] = tuple(GEMMA3_DEFAULTS.items())

    def text_config(self, hf: dict) -> dict:
        hf = super().text_config(hf)
        # transformers 5: `rope_parameters` per layer type; released configs: the released form. Normalised to the
        # released form: `rope_parameters` the full layers' RoPE, `rope_local_base_freq` the sliding layers'.
        params = hf.get("rope_parameters")
        if isinstance(params, dict) and set(params) & set(LAYER_TYPES):
            full = dict(params.get("full_attention") or {})
            local = dict(params.get("sliding_attention") or {})
        else:
            full = dict(hf.get("rope_scaling") or params or {})
            local = {"rope_theta": hf["rope_local_base_freq"]}
        full.setdefault("rope_theta", hf["rope_theta"])
        local_type = local.get("rope_type", local.get("type", "default"))
        if local_type != "default":
            raise FamilyConfigError(f"config.json rope_parameters.sliding_attention.rope_type={local_type!r} is not "
                                    "supported; Gemma 3's sliding layers run unscaled RoPE ('default')")
        hf.pop("rope_scaling", None)
        return {**hf, "rope_parameters": full, "rope_theta": full["rope_theta"],
                "rope_local_base_freq": local.get("rope_theta", hf["rope_local_base_freq"])}

    def attention(self, hf: dict) -> FamilyAttention:
        return dataclasses.replace(super().attention(hf), qk_norm=True)  # a Gemma RMSNorm per query and key head

    def style(self, hf: dict) -> LayerStyle:
        pattern = hf["sliding_window_pattern"]
        if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
            raise FamilyConfigError(f"config.json sliding_window_pattern={pattern!r}: must be a whole number >= 1")
        base = super().style(hf)
        return LayerStyle(gemma_norms=True, query_pre_attn_scalar=base.query_pre_attn_scalar,
                          attn_logit_softcap=base.attn_logit_softcap, final_logit_softcap=base.final_logit_softcap,
                          layer_types=_layer_types(hf, pattern),
                          local_rope_theta=_positive(hf, "rope_local_base_freq"))


# The outer config.json fields of a multimodal checkpoint that the text model uses (they win over text_config's).
_OUTER_FIELDS = ("eos_token_id", "bos_token_id", "tie_word_embeddings")


@dataclass(frozen=True)
class Gemma3(Gemma3Text):
    """Gemma 3's multimodal checkpoints (`Gemma3ForConditionalGeneration`): the text model only. Its fields are
    config.json's `text_config`; its tensors sit under `model.language_model.` (transformers 5) or
    `language_model.model.` (released checkpoints). The engine takes token ids, so an image cannot reach it; a
    prompt holding the image token (`image_token_index`) is refused (engine/sizing/capacity.py)."""

    def text_config(self, hf: dict) -> dict:
        text = hf.get("text_config")
        if not isinstance(text, dict):
            raise FamilyConfigError("config.json of a gemma3 checkpoint has no text_config object; is this the "
                                    "model's own config.json?")
        outer = {k: hf[k] for k in _OUTER_FIELDS if hf.get(k) is not None}
        image = hf.get("image_token_index", hf.get("image_token_id", 262144))
        return {**super().text_config({**text, **outer}), "image_token_index": image}

    def style(self, hf: dict) -> LayerStyle:
        # transformers' Gemma3ForConditionalGeneration never applies text_config's final_logit_softcapping (only
        # Gemma3ForCausalLM does); the released configs leave it null.
        return dataclasses.replace(super().style(hf), final_logit_softcap=None)


GEMMA2 = Gemma2("gemma2", "Gemma2ForCausalLM")
GEMMA3_TEXT = Gemma3Text("gemma3_text", "Gemma3ForCausalLM")
GEMMA3 = Gemma3("gemma3", "Gemma3ForConditionalGeneration",
                weight_prefixes=(("model.", "model.language_model."), ("model.", "language_model.model."),
                                 ("lm_head.", "language_model.lm_head.")))
