"""Mistral (`model_type: mistral`): Llama's layers with sliding-window attention on every layer when
config.json sets `sliding_window`."""

from __future__ import annotations

from dataclasses import dataclass

from engine.models.model_family import FamilyAttention, ModelFamily


@dataclass(frozen=True)
class Mistral(ModelFamily):
    def attention(self, hf: dict) -> FamilyAttention:
        window = hf.get("sliding_window")
        return FamilyAttention(qkv_bias=bool(hf.get("attention_bias", False)),
                               sliding_window=int(window) if window else None)


MISTRAL = Mistral("mistral", "MistralForCausalLM")
