"""Qwen2-MoE (`model_type: qwen2_moe`, Qwen1.5-MoE and Qwen2-57B-A14B): Qwen2's attention (q/k/v biases unless
`qkv_bias` is false) and Qwen3-MoE's mixture of experts (engine/models/qwen3_moe.py), plus a shared expert on every
sparse layer: a SwiGLU MLP of width `shared_expert_intermediate_size` that every token runs, scaled by a sigmoid gate
(`mlp.shared_expert_gate`, one output) and added to the routed experts' output."""

from __future__ import annotations

from dataclasses import dataclass

from engine.models.model_family import FamilyAttention
from engine.models.moe_config import MoeConfig
from engine.models.qwen2 import Qwen2
from engine.models.qwen3_moe import qwen_moe


@dataclass(frozen=True)
class Qwen2Moe(Qwen2):
    def attention(self, hf: dict) -> FamilyAttention:
        attention = super().attention(hf)
        return FamilyAttention(qkv_bias=bool(hf.get("qkv_bias", True)), sliding_window=attention.sliding_window)

    def moe(self, hf: dict) -> MoeConfig:
        return qwen_moe(hf, experts=60, top_k=4, size=1408, shared=5632)


QWEN2_MOE = Qwen2Moe("qwen2_moe", "Qwen2MoeForCausalLM")
