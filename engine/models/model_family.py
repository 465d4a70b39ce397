"""What a model family is to the engine: the small interface each family file fills in. No JAX here.

The layers are shared (engine/models/model.py: RMSNorm, rotary attention with GQA, a SwiGLU MLP); a family states
what is special about it: how its config.json spells the knobs of those shared layers (biases on the q/k/v
projections, sliding-window attention) and what it refuses. One file per family (engine/models/llama.py,
engine/models/mistral.py, engine/models/qwen2.py, engine/models/qwen3.py), registered by config.json's `model_type` in engine/models/model_registry.py: a
new family (gemma's soft-capping, mixtral's experts) is one new file, one registry line and a
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
    qk_norm: bool = False  # an RMSNorm over each query and key head before RoPE (`q_norm`, `k_norm`: Qwen3)


@dataclass(frozen=True)
class ModelFamily:
    """One model family: its config.json `model_type` and Hugging Face architecture name, and how its
    config.json sets the shared layers (`attention`)."""

    model_type: str
    architecture: str  # config.json `architectures[0]` of the family's checkpoints

    def attention(self, hf: dict) -> FamilyAttention:
        """The attention settings a config.json of this family asks for; FamilyConfigError when unsupported."""
        raise NotImplementedError

    def moe(self, hf: dict) -> MoeConfig | None:
        """The mixture of experts a config.json of this family asks for (None: a dense MLP on every layer)."""
        return None
