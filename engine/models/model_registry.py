"""The model families the engine runs, by config.json's `model_type`: one line per family file. No JAX here."""

from __future__ import annotations

from engine.models.gemma import GEMMA2, GEMMA3, GEMMA3_TEXT
from engine.models.llama import LLAMA
from engine.models.mistral import MISTRAL
from engine.models.mixtral import MIXTRAL
from engine.models.model_family import ModelFamily
from engine.models.qwen2 import QWEN2
from engine.models.qwen2_moe import QWEN2_MOE
from engine.models.qwen3 import QWEN3
from engine.models.qwen3_moe import QWEN3_MOE

FAMILIES: dict[str, ModelFamily] = {f.model_type: f for f in (LLAMA, MISTRAL, QWEN2, QWEN3, GEMMA2, GEMMA3_TEXT, GEMMA3,
                                                               MIXTRAL, QWEN3_MOE, QWEN2_MOE)}
"""Every supported family, keyed by `model_type`, in the order the error messages list them."""


def model_family(model_type: str | None) -> ModelFamily | None:
    """The family of a config.json's `model_type`, or None when the engine does not run it."""
    return FAMILIES.get(model_type) if model_type is not None else None
