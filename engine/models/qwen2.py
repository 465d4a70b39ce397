"""Qwen2 (`model_type: qwen2`): Llama's layers with biases on the q/k/v projections, always; a sliding window
only with `use_sliding_window`, and then on every layer (a window on only some layers, `max_window_layers`
below the layer count, would need per-layer-group page tables: refused)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.models.model_family import FamilyAttention, FamilyConfigError, ModelFamily


@dataclass(frozen=True)
class Qwen2(ModelFamily):
    def attention(self, hf: dict) -> FamilyAttention:
        window = hf.get("sliding_window") if hf.get("use_sliding_window", False) else None
        if window is not None and hf.get("max_window_layers", hf["num_hidden_layers"]) < hf["num_hidden_layers"]:
            raise FamilyConfigError(
                "config.json use_sliding_window with max_window_layers < num_hidden_layers is not supported")
        return FamilyAttention(qkv_bias=True, sliding_window=int(window) if window else None)


QWEN2 = Qwen2("qwen2", "Qwen2ForCausalLM")
