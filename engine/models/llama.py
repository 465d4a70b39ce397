"""Llama (`model_type: llama`): the shared layers as they are; q/k/v biases only when config.json's
`attention_bias` says so, full attention on every layer. Llama 3's rope scaling is read by ModelConfig (it is
the shared rotary embedding's, not the family's)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.models.model_family import FamilyAttention, ModelFamily


@dataclass(frozen=True)
class Llama(ModelFamily):
    def attention(self, hf: dict) -> FamilyAttention:
        return FamilyAttention(qkv_bias=bool(hf.get("attention_bias", False)), sliding_window=None)


LLAMA = Llama("llama", "LlamaForCausalLM")
