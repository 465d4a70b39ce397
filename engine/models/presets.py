"""Randomly initialised Hugging Face-format checkpoints for demos, tests and benchmarks.

`write_model(preset, output)` writes config.json, model.safetensors (float32, HF weight names,
torch Linear layout [out_features, in_features]), generation_config.json and the tokenizer files
of `engine.tokenizer.tokenizer_builder` into `output`. Output is a pure function of (preset, seed).
"""

from __future__ import annotations

import json
import math
import os
import pathlib
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from safetensors.numpy import save_file

from engine.models.model_registry import FAMILIES
from engine.tokenizer.tokenizer_builder import write_tokenizer

# Initialisation scales. Tests compare our engine's greedy decoding with transformers token for
# token, so the gap between the top two logits must dwarf float32 rounding (~1e-6 relative).
# Unit-variance embeddings and Linear weights of variance 1/fan_in keep every activation O(1)
# through the stack; norm weights away from 1 and nonzero biases make sure those parameters are
# actually exercised; a large lm_head scale spreads the logits (std ~LM_HEAD_LOGIT_STD).
EMBED_STD = 1.0
"""Std of token embeddings."""
NORM_WEIGHT_STD = 0.1
"""RMSNorm weights are 1 + N(0, NORM_WEIGHT_STD**2)."""
BIAS_STD = 0.1
"""Std of attention biases (Qwen2)."""
LM_HEAD_LOGIT_STD = 8.0
"""lm_head weights are N(0, (LM_HEAD_LOGIT_STD / sqrt(hidden_size))**2): logits have std ~8.
With tied embeddings the head is the N(0, 1) embedding table, so logits have std ~sqrt(hidden_size)
(8 for the tiny presets' hidden size 64)."""

Family = Literal["llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe", "qwen2_moe", "gemma2", "gemma3_text"]


@dataclass(frozen=True)
class Preset:
    """The shape and hyperparameters of one randomly initialised model."""

    family: Family
    """Model family: sets `model_type`, `architectures` and family-specific keys."""
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    """Fewer than `num_attention_heads` in every preset (grouped-query attention)."""
    head_dim: int
    vocab_size: int
    """Equals the trained tokenizer's size, special tokens included."""
    max_position_embeddings: int
    """Context length in tokens; also the tokenizer's `model_max_length`."""
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None = None
    """HF `rope_scaling` (e.g. llama3) or None for plain RoPE."""
    tie_word_embeddings: bool = False
    """When True, lm_head shares `model.embed_tokens.weight` and is not written."""
    num_experts: int = 0
    """A mixture of experts (mixtral, qwen3_moe): experts per sparse layer; 0 for the dense families."""
    experts_per_token: int = 0
    expert_size: int = 0
    """Each expert's MLP width (Mixtral's is intermediate_size)."""
    dense_layers: tuple[int, ...] = ()
    """Qwen3-MoE's `mlp_only_layers`: layers with the dense MLP."""
    shared_expert_size: int = 0
    """Qwen2-MoE's shared expert width (0: none)."""
    sliding_window: int | None = None
    """Gemma: the sliding-window layers' window in tokens."""
    full_attention_every: int = 0
    """Gemma: every this-many-th layer attends to the whole context, the others within `sliding_window`."""
    attn_logit_softcap: float | None = None
    """Gemma 2: attention scores soft-capped at this value."""
    final_logit_softcap: float | None = None
    """Gemma 2 (and Gemma 3's causal LM): logits soft-capped at this value."""
    local_rope_theta: float | None = None
    """Gemma 3: the sliding layers' RoPE base (the full layers' is `rope_theta`, scaled by `rope_scaling`)."""

    @property
    def gemma(self) -> bool:
        """Gemma's layer: (1 + weight) norms, four a layer, embeddings scaled by sqrt(hidden_size), a GeGLU MLP."""
        return self.family in ("gemma2", "gemma3_text")

    def layer_types(self) -> list[str]:
        return ["sliding_attention" if (i + 1) % self.full_attention_every else "full_attention"
                for i in range(self.num_hidden_layers)]

    def sparse(self, layer: int) -> bool:
        return self.num_experts > 0 and layer not in self.dense_layers

    @property
    def qk_norm(self) -> bool:
        """Qwen3 and Gemma 3 normalise each query and key head (weights of head_dim); the others do not."""
        return self.family in ("qwen3", "qwen3_moe", "gemma3_text")

    @property
    def attention_bias(self) -> bool:
        """Qwen2 has biases on q/k/v projections; the others have none."""
        return self.family in ("qwen2", "qwen2_moe")

    @property
    def tokenizer_pipeline(self) -> str:
        """The built-in tokenizer's pipeline (engine.tokenizer.tokenizer_builder.Pipeline): Qwen's families (Qwen2,
        Qwen2-MoE, Qwen3, Qwen3-MoE) share Qwen2's tokenizer, which NFC-normalises; the others are plain byte-level."""
        return "qwen2" if self.family in ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe") else "byte_level"

    def hf_config(self, bos_token_id: int, eos_token_id: int) -> dict[str, Any]:
        """The config.json dict in classic HF form (`rope_theta`/`rope_scaling` at top level)."""
        config: dict[str, Any] = {
            "architectures": [FAMILIES[self.family].architecture],
            "model_type": self.family,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "tie_word_embeddings": self.tie_word_embeddings,
            "vocab_size": self.vocab_size,
            "bos_token_id": bos_token_id,
            "eos_token_id": eos_token_id,
            "torch_dtype": "float32",
            "initializer_range": 0.02,
            "attention_dropout": 0.0,
            "use_cache": True,
        }
        if self.family == "llama":
            config.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
        elif self.family == "mistral":
            config.update(sliding_window=None)
        elif self.family in ("qwen3", "qwen3_moe"):
            config.update(attention_bias=False, use_sliding_window=False, sliding_window=None,
                          max_window_layers=self.num_hidden_layers)
            if self.family == "qwen3_moe":
                config.update(num_experts=self.num_experts, num_experts_per_tok=self.experts_per_token,
                              moe_intermediate_size=self.expert_size, norm_topk_prob=False, decoder_sparse_step=1,
                              mlp_only_layers=list(self.dense_layers))
        elif self.family == "qwen2_moe":
            config.update(use_sliding_window=False, sliding_window=None, max_window_layers=self.num_hidden_layers,
                          qkv_bias=True, num_experts=self.num_experts, num_experts_per_tok=self.experts_per_token,
                          moe_intermediate_size=self.expert_size, norm_topk_prob=False, decoder_sparse_step=1,
                          mlp_only_layers=list(self.dense_layers),
                          shared_expert_intermediate_size=self.shared_expert_size)
        elif self.family == "mixtral":
            config.update(sliding_window=None, num_local_experts=self.num_experts,
                          num_experts_per_tok=self.experts_per_token)
        elif self.gemma:
            del config["hidden_act"]
            config.update(hidden_activation="gelu_pytorch_tanh", attention_bias=False,
                          query_pre_attn_scalar=self.head_dim, sliding_window=self.sliding_window,
                          layer_types=self.layer_types(), attn_logit_softcapping=self.attn_logit_softcap,
                          final_logit_softcapping=self.final_logit_softcap)
            if self.family == "gemma3_text":
                config.update(rope_local_base_freq=self.local_rope_theta,
                              sliding_window_pattern=self.full_attention_every)
        else:
            config.update(use_sliding_window=False, sliding_window=None, max_window_layers=self.num_hidden_layers)
        return config

    def init_weights(self, seed: int) -> dict[str, np.ndarray]:
        """Random float32 weights under HF names, Linear layout [out_features, in_features]."""
        rng = np.random.default_rng(seed)
        h, q_dim, kv_dim = self.hidden_size, self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim

        def linear(out_features: int, in_features: int) -> np.ndarray:
            return rng.normal(0.0, 1.0 / math.sqrt(in_features), (out_features, in_features)).astype(np.float32)

        center = 0.0 if self.gemma else 1.0  # Gemma's norms scale by (1 + weight)

        def norm(width: int = h) -> np.ndarray:
            return (center + rng.normal(0.0, NORM_WEIGHT_STD, (width,))).astype(np.float32)

        weights = {"model.embed_tokens.weight": rng.normal(0.0, EMBED_STD, (self.vocab_size, h)).astype(np.float32)}
        for i in range(self.num_hidden_layers):
            p = f"model.layers.{i}."
            weights[p + "self_attn.q_proj.weight"] = linear(q_dim, h)
            weights[p + "self_attn.k_proj.weight"] = linear(kv_dim, h)
            weights[p + "self_attn.v_proj.weight"] = linear(kv_dim, h)
            weights[p + "self_attn.o_proj.weight"] = linear(h, q_dim)
            if self.attention_bias:
                for name, dim in (("q", q_dim), ("k", kv_dim), ("v", kv_dim)):
                    weights[p + f"self_attn.{name}_proj.bias"] = rng.normal(0.0, BIAS_STD, (dim,)).astype(np.float32)
            if self.qk_norm:
                for name in ("q_norm", "k_norm"):
                    weights[p + f"self_attn.{name}.weight"] = norm(self.head_dim)
            if self.sparse(i):
                mlp, names = ("block_sparse_moe", ("w1", "w3", "w2")) if self.family == "mixtral" else (
                    "mlp", ("gate_proj", "up_proj", "down_proj"))
                weights[p + f"{mlp}.gate.weight"] = linear(self.num_experts, h)
                for e in range(self.num_experts):
                    weights[p + f"{mlp}.experts.{e}.{names[0]}.weight"] = linear(self.expert_size, h)
                    weights[p + f"{mlp}.experts.{e}.{names[1]}.weight"] = linear(self.expert_size, h)
                    weights[p + f"{mlp}.experts.{e}.{names[2]}.weight"] = linear(h, self.expert_size)
                if self.shared_expert_size:
                    weights[p + "mlp.shared_expert.gate_proj.weight"] = linear(self.shared_expert_size, h)
                    weights[p + "mlp.shared_expert.up_proj.weight"] = linear(self.shared_expert_size, h)
                    weights[p + "mlp.shared_expert.down_proj.weight"] = linear(h, self.shared_expert_size)
                    weights[p + "mlp.shared_expert_gate.weight"] = linear(1, h)
            else:
                weights[p + "mlp.gate_proj.weight"] = linear(self.intermediate_size, h)
                weights[p + "mlp.up_proj.weight"] = linear(self.intermediate_size, h)
                weights[p + "mlp.down_proj.weight"] = linear(h, self.intermediate_size)
            weights[p + "input_layernorm.weight"] = norm()
            weights[p + "post_attention_layernorm.weight"] = norm()
            if self.gemma:
                weights[p + "pre_feedforward_layernorm.weight"] = norm()
                weights[p + "post_feedforward_layernorm.weight"] = norm()
        weights["model.norm.weight"] = norm()
        if not self.tie_word_embeddings:
            weights["lm_head.weight"] = rng.normal(0.0, LM_HEAD_LOGIT_STD / math.sqrt(h), (self.vocab_size, h)).astype(np.float32)
        return weights

    @property
    def num_parameters(self) -> int:
        """Parameter count (tied embeddings counted once)."""
        h, q_dim, kv_dim = self.hidden_size, self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        per_layer = 2 * h * q_dim + 2 * h * kv_dim + (4 if self.gemma else 2) * h
        shared = 3 * h * self.shared_expert_size + h if self.shared_expert_size else 0  # and its gate
        mlps = sum(self.num_experts * (3 * h * self.expert_size + h) + shared if self.sparse(i)
                   else 3 * h * self.intermediate_size for i in range(self.num_hidden_layers))
        if self.attention_bias:
            per_layer += q_dim + 2 * kv_dim
        if self.qk_norm:
            per_layer += 2 * self.head_dim
        heads = 1 if self.tie_word_embeddings else 2
        return self.num_hidden_layers * per_layer + mlps + h + heads * self.vocab_size * h


# With factor 8 and original context 256, wavelengths above 256 tokens are stretched, so the
# llama3 scaling changes the frequencies at the sequence lengths our tests use.
_LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 256}

PRESETS: dict[str, Preset] = {
    "tiny-llama": Preset("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=512, max_position_embeddings=2048,
                         rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=_LLAMA3_SCALING),
    "tiny-mistral": Preset("mistral", hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=1, head_dim=16, vocab_size=512, max_position_embeddings=2048,
                           rms_norm_eps=1e-5, rope_theta=10000.0),
    "tiny-qwen2": Preset("qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=512, max_position_embeddings=2048,
                         rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True),
    # head_dim 32 with 4 heads of a 64-wide model: q is 128 wide, twice hidden_size (Qwen3 states head_dim).
    "tiny-qwen3": Preset("qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32, vocab_size=512, max_position_embeddings=2048,
                         rms_norm_eps=1e-6, rope_theta=1000000.0),
    "tiny-mixtral": Preset("mixtral", hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=16, vocab_size=512, max_position_embeddings=2048,
                           rms_norm_eps=1e-5, rope_theta=1000000.0, num_experts=8, experts_per_token=2,
                           expert_size=96),
    "tiny-qwen3-moe": Preset("qwen3_moe", hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=512,
                             max_position_embeddings=2048, rms_norm_eps=1e-6, rope_theta=1000000.0, num_experts=8,
                             experts_per_token=3, expert_size=48, dense_layers=(1,)),
    # Qwen2-MoE: tiny-qwen3-moe's experts without QK-norm, with q/k/v biases and a shared expert 96 wide.
    "tiny-qwen2-moe": Preset("qwen2_moe", hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512,
                             max_position_embeddings=2048, rms_norm_eps=1e-6, rope_theta=1000000.0, num_experts=8,
                             experts_per_token=3, expert_size=48, dense_layers=(1,), shared_expert_size=96),
    # Gemma 2: layers alternating sliding (a 32-token window) and full, soft-capped scores and logits (Gemma 2's
    # released caps).
    "tiny-gemma2": Preset("gemma2", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, vocab_size=512, max_position_embeddings=2048,
                          rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=True, sliding_window=32,
                          full_attention_every=2, attn_logit_softcap=50.0, final_logit_softcap=30.0),
    # Gemma 3: five sliding layers (a 32-token window, RoPE base 10,000) to one full (base 1e6, linear scaling 8),
    # QK-norm, no soft-capping, as the released Gemma 3 models.
    "tiny-gemma3": Preset("gemma3_text", hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512,
                          max_position_embeddings=2048, rms_norm_eps=1e-6, rope_theta=1000000.0,
                          rope_scaling={"rope_type": "linear", "factor": 8.0}, tie_word_embeddings=True,
                          sliding_window=32, full_attention_every=6, local_rope_theta=10000.0),
    "llama-40m": Preset("llama", hidden_size=512, intermediate_size=1536, num_hidden_layers=10, num_attention_heads=8,
                        num_key_value_heads=4, head_dim=64, vocab_size=8192, max_position_embeddings=4096,
                        rms_norm_eps=1e-5, rope_theta=500000.0),
}
"""Built-in presets by name. All use grouped-query attention."""


def write_model(preset: str | Preset, output: str | os.PathLike, seed: int = 0) -> pathlib.Path:
    """Write preset `preset` (a name in PRESETS, or a `Preset` of its own shape) with weights drawn from
    `seed` into directory `output` (created).

    Same (preset, seed) gives byte-identical files. Returns the output directory.
    """
    if isinstance(preset, Preset):
        spec = preset
    elif preset in PRESETS:
        spec = PRESETS[preset]
    else:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(sorted(PRESETS))}")
    out = pathlib.Path(output)
    out.mkdir(parents=True, exist_ok=True)
    ids = write_tokenizer(out, spec.vocab_size, spec.max_position_embeddings, spec.tokenizer_pipeline)
    (out / "config.json").write_text(json.dumps(spec.hf_config(**ids), indent=2) + "\n")
    generation_config = {**ids, "pad_token_id": ids["eos_token_id"], "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(generation_config, indent=2) + "\n")
    save_file(spec.init_weights(seed), str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
