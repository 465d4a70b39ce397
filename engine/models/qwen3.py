"""Qwen3 (`model_type: qwen3`): Llama's layers with an RMSNorm over each query and key head before RoPE
(`self_attn.q_norm`, `self_attn.k_norm`, one weight of `head_dim` shared by the heads) and an explicit `head_dim`
that may differ from hidden_size / num_attention_heads (read by ModelConfig); q/k/v biases only when
`attention_bias` says so. Sliding windows (`use_sliding_window`, `layer_types` with `sliding_attention`) are
refused: no released Qwen3 uses them, and one on only some layers needs per-layer-group page tables."""

from __future__ import annotations

from dataclasses import dataclass

from engine.models.model_family import FamilyAttention, FamilyConfigError, ModelFamily


@dataclass(frozen=True)
class Qwen3(ModelFamily):
    def attention(self, hf: dict) -> FamilyAttention:
        if hf.get("use_sliding_window", False):
            raise FamilyConfigError(f"config.json use_sliding_window=true is not supported for "
                                    f"model_type={self.model_type}; set it to false")
        types = hf.get("layer_types") or []
        if any(t != "full_attention" for t in types):
            raise FamilyConfigError(f"config.json layer_types holds {sorted(set(types) - {'full_attention'})}; "
                                    f"model_type={self.model_type} runs only 'full_attention' layers")
        return FamilyAttention(qkv_bias=bool(hf.get("attention_bias", False)), sliding_window=None, qk_norm=True)


QWEN3 = Qwen3("qwen3", "Qwen3ForCausalLM")
