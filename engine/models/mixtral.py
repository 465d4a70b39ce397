"""Mixtral (`model_type: mixtral`): Llama's attention (a sliding window on every layer when `sliding_window` is set)
and a mixture of experts on every layer: the router takes the softmax over all `num_local_experts`, keeps the top
`num_experts_per_tok` and renormalizes them to sum to one; experts `block_sparse_moe.experts.{e}.w1/w3/w2` (gate,
up, down) of width `intermediate_size`."""

from __future__ import annotations

from dataclasses import dataclass

from engine.models.mistral import Mistral
from engine.models.model_family import FamilyConfigError
from engine.models.moe_config import MoeConfig


@dataclass(frozen=True)
class Mixtral(Mistral):
    def moe(self, hf: dict) -> MoeConfig:
        experts, top_k = hf.get("num_local_experts", 8), hf.get("num_experts_per_tok", 2)
        if not (isinstance(experts, int) and isinstance(top_k, int) and 1 <= top_k <= experts <= 4096):
            raise FamilyConfigError(f"config.json num_local_experts={experts!r} and num_experts_per_tok={top_k!r}: "
                                    "need 1 <= num_experts_per_tok <= num_local_experts <= 4096")
        return MoeConfig(num_experts=experts, top_k=top_k, expert_size=hf["intermediate_size"], renormalize=True,
                         sparse_layers=(True,) * hf["num_hidden_layers"], prefix="block_sparse_moe", router="gate",
                         expert_names=("w1", "w3", "w2"),
                         fields=("num_local_experts", "intermediate_size"))


MIXTRAL = Mixtral("mixtral", "MixtralForCausalLM")
