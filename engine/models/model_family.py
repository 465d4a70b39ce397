"""What a model family is to the engine: the small interface each family file fills in. No JAX here.

The layers are shared (engine/models/model.py: RMSNorm, rotary attention with GQA, a SwiGLU MLP); a family states
what is special about it: how its config.json spells the knobs of those shared layers (biases on the q/k/v
projections, sliding-window attention, QK-norm), where its decoder's fields and tensors sit (a multimodal checkpoint
nests them), the layer style it needs beyond Llama's (`LayerStyle`: Gemma's norms, soft-capping, per-layer windows),
its mixture of experts, and what it refuses. One file per family (engine/models/llama.py, mistral.py, qwen2.py,
qwen3.py, gemma.py, mixtral.py, qwen3_moe.py), registered by config.json's `model_type` in
engine/models/model_registry.py: a new family is one new file, one registry line and a
test, plus the shared layer it needs when it needs a new one.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.models.moe_config import MoeConfig


class FamilyConfigError(ValueError):
    """A config.json this family cannot run (the caller reports it as an UnsupportedModelError)."""


@dataclass(frozen=True)
class FamilyAttention:
    """The family's settings of the shared attention layer, read from its config.json."""

    qkv_bias: bool  # biases on the q, k and v projections
    sliding_window: int | None  # tokens each query sees (its own included); None: the whole context
    qk_norm: bool = False  # an RMSNorm (the family's kind) over each query and key head before RoPE (Qwen3, Gemma 3)


LAYER_TYPES = ("full_attention", "sliding_attention")
"""config.json `layer_types` values: full causal attention, or attention within `sliding_window`."""


@dataclass(frozen=True)
class LayerStyle:
    """What a family's decoder does beyond Llama's; the defaults are Llama's."""

    gemma_norms: bool = False
    """Gemma's layer: RMSNorm as x / rms(x) * (1 + weight) in float32; four norms per layer (input, post-attention,
    pre- and post-feedforward); embeddings multiplied by sqrt(hidden_size) in the weights' dtype."""
    query_pre_attn_scalar: float | None = None
    """Scores are multiplied by this ** -0.5; None: by head_dim ** -0.5."""
    attn_logit_softcap: float | None = None
    """Attention scores s become C * tanh(s / C) (in the kernels, before the mask); None: no cap."""
    final_logit_softcap: float | None = None
    """Logits z become C * tanh(z / C); None: no cap."""
    layer_types: tuple[str, ...] | None = None
    """Each layer's attention (LAYER_TYPES); None: every layer as the model's `sliding_window` says."""
    local_rope_theta: float | None = None
    """RoPE base of the sliding-window layers, unscaled (Gemma 3); None: the model's RoPE on every layer."""


@dataclass(frozen=True)
class ModelFamily:
    """One model family: its config.json `model_type` and Hugging Face architecture name, and how its
    config.json sets the shared layers (`attention`)."""

    model_type: str
    architecture: str  # config.json `architectures[0]` of the family's checkpoints
    weight_prefixes: tuple[tuple[str, str], ...] = ()
    """(the engine's name prefix, a prefix the checkpoint may store it under instead), tried in order: a
    multimodal checkpoint keeps its text decoder under its own prefix (`model.language_model.`)."""

    def text_config(self, hf: dict) -> dict:
        """The decoder's config.json fields, transformers' defaults filled in where the family's config class has
        them (released configs omit fields at their default); FamilyConfigError when unsupported."""
        return hf

    def activation(self, hf: dict) -> str:
        """The MLP's gate activation (transformers' ACT2FN name)."""
        return hf.get("hidden_act", "silu")

    def style(self, hf: dict) -> LayerStyle:
        """The layer style beyond Llama's that `text_config(hf)` asks for; FamilyConfigError when unsupported."""
        return LayerStyle()

    def attention(self, hf: dict) -> FamilyAttention:
        """The attention settings a config.json of this family asks for; FamilyConfigError when unsupported."""
        raise NotImplementedError

    def moe(self, hf: dict) -> MoeConfig | None:
        """The mixture of experts a config.json of this family asks for (None: a dense MLP on every layer)."""
        return None
