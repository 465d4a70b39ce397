"""Qwen3-MoE (`model_type: qwen3_moe`): Qwen3's attention (QK-norm, explicit head_dim) and a mixture of experts:
the router takes the softmax over `num_experts`, keeps the top `num_experts_per_tok` and renormalizes them only when
`norm_topk_prob` is true; experts `mlp.experts.{e}.gate_proj/up_proj/down_proj` of width `moe_intermediate_size`.
Layer i is sparse when it is not in `mlp_only_layers` and (i + 1) is a multiple of `decoder_sparse_step`; the
others are dense MLPs of width `intermediate_size`."""

from __future__ import annotations

from dataclasses import dataclass

from engine.models.model_family import FamilyConfigError
from engine.models.moe_config import MoeConfig
from engine.models.qwen3 import Qwen3


@dataclass(frozen=True)
class Qwen3Moe(Qwen3):
    def moe(self, hf: dict) -> MoeConfig:
        return qwen_moe(hf, experts=128, top_k=8, size=768)


def qwen_moe(hf: dict, experts: int, top_k: int, size: int, shared: int | None = None) -> MoeConfig:
    """The mixture of experts of a Qwen3-MoE or Qwen2-MoE config.json (the defaults: its config class's); `shared`:
    Qwen2-MoE's default `shared_expert_intermediate_size` (None: the family has no shared expert)."""
    # Released checkpoints write num_experts; transformers 5's save_pretrained writes num_local_experts.
    field = "num_experts" if "num_experts" in hf else "num_local_experts"
    experts, top_k = hf.get(field, experts), hf.get("num_experts_per_tok", top_k)
    if not (isinstance(experts, int) and isinstance(top_k, int) and 1 <= top_k <= experts <= 4096):
        raise FamilyConfigError(f"config.json {field}={experts!r} and num_experts_per_tok={top_k!r}: "
                                f"need 1 <= num_experts_per_tok <= {field} <= 4096")
    step = hf.get("decoder_sparse_step", 1)
    if not isinstance(step, int) or step < 1:
        raise FamilyConfigError(f"config.json decoder_sparse_step={step!r}: must be a whole number from 1")
    widths = {"moe_intermediate_size": hf.get("moe_intermediate_size", size)}
    if shared is not None:
        widths["shared_expert_intermediate_size"] = hf.get("shared_expert_intermediate_size", shared)
    for name, width in widths.items():
        if not isinstance(width, int) or not 1 <= width <= 1 << 21:
            raise FamilyConfigError(f"config.json {name}={width!r}: must be a whole number from 1")
    dense = set(hf.get("mlp_only_layers") or [])
    layers = hf["num_hidden_layers"]
    return MoeConfig(num_experts=experts, top_k=top_k, expert_size=widths["moe_intermediate_size"],
                     renormalize=bool(hf.get("norm_topk_prob", False)),
                     sparse_layers=tuple(i not in dense and (i + 1) % step == 0 for i in range(layers)),
                     prefix="mlp", router="gate", expert_names=("gate_proj", "up_proj", "down_proj"),
                     fields=(field, "moe_intermediate_size"),
                     shared_expert_size=widths.get("shared_expert_intermediate_size", 0))


QWEN3_MOE = Qwen3Moe("qwen3_moe", "Qwen3MoeForCausalLM")
