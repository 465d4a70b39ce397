"""A mixture-of-experts MLP as config.json describes it: how many experts, how many each token uses, how the router
weighs them, which layers are sparse and where the checkpoint keeps the tensors. No JAX here; the layer is
engine/models/moe.py."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MoeConfig:
    num_experts: int
    top_k: int  # experts per token
    expert_size: int  # each expert's MLP width (gate/up outputs)
    renormalize: bool  # the top-k router weights divided by their sum (Mixtral always; Qwen3-MoE: norm_topk_prob)
    sparse_layers: tuple[bool, ...]  # per layer: experts (True) or the dense MLP of width intermediate_size
    prefix: str  # the layer's MLP in the checkpoint: "block_sparse_moe" (Mixtral) or "mlp" (Qwen3-MoE)
    router: str  # the router's tensor under `prefix`: "gate"
    expert_names: tuple[str, str, str]  # each expert's gate, up and down projections: ("w1", "w3", "w2") for Mixtral
    fields: tuple[str, str]  # the config.json fields of the number of experts and of `expert_size`
    shared_expert_size: int = 0
    """Qwen2-MoE's shared expert: a SwiGLU MLP of this width that every token runs, gated by a sigmoid (0: none)."""

    def expert_tensor(self, layer: int, expert: int, which: int) -> str:
        """The Hugging Face name of expert `expert`'s projection `which` (0 gate, 1 up, 2 down) in layer `layer`."""
        return f"model.layers.{layer}.{self.prefix}.experts.{expert}.{self.expert_names[which]}.weight"

    def router_tensor(self, layer: int) -> str:
        return f"model.layers.{layer}.{self.prefix}.{self.router}.weight"

    def shared_tensor(self, layer: int, which: int) -> str:
        """The shared expert's projection `which` (0 gate, 1 up, 2 down) in layer `layer`."""
        return f"model.layers.{layer}.{self.prefix}.shared_expert.{('gate_proj', 'up_proj', 'down_proj')[which]}.weight"

    def shared_gate_tensor(self, layer: int) -> str:
        """The shared expert's gate: one output per token, through a sigmoid."""
        return f"model.layers.{layer}.{self.prefix}.shared_expert_gate.weight"
