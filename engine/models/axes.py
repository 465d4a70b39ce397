"""Every named axis of the engine, in one place. Sizes come from the model and engine configs."""

from __future__ import annotations

from dataclasses import dataclass

import haliax as hax

from engine.models.model_config import ModelConfig

# Axis names; the tensor-parallel mapping shards the ones in TENSOR_PARALLEL over the mesh's `model` axis.
LAYERS = "layers"
EMBED = "embed"
VOCAB = "vocab"
MLP = "mlp"
KV_HEADS = "kv_heads"
Q_PER_KV = "q_per_kv"
HEAD_SIZE = "head_size"
TOKEN = "token"
PAGE = "page"
PAGE_SLOT = "page_slot"
KV_COMBINED = "kv_combined"  # K and V interleaved per KV head: k0 v0 k1 v1 ...
EXPERTS = "experts"  # a mixture of experts' experts (engine/models/moe.py)
EXPERT_MLP = "expert_mlp"  # one expert's MLP width
ROUTES = "routes"  # the router's output: one score per expert (the router is replicated; the experts are not)
SHARED_MLP = "shared_mlp"  # a shared expert's MLP width (Qwen2-MoE), split over `model` as the dense MLP's
SHARED_GATE = "shared_gate"  # the shared expert's gate: one output

# A mixture of experts is spread over `model` whole (expert parallelism): each device holds num_experts / T experts;
# the router, which every device runs, is replicated.
TENSOR_PARALLEL = {KV_HEADS: "model", MLP: "model", KV_COMBINED: "model", EXPERTS: "model", SHARED_MLP: "model"}


@dataclass(frozen=True)
class ModelAxes:
    Layers: hax.Axis
    Embed: hax.Axis
    Vocab: hax.Axis
    Mlp: hax.Axis
    KVHeads: hax.Axis
    QPerKV: hax.Axis
    HeadSize: hax.Axis

    @classmethod
    def of(cls, config: ModelConfig) -> "ModelAxes":
        return cls(
            Layers=hax.Axis(LAYERS, config.num_layers),
            Embed=hax.Axis(EMBED, config.hidden_size),
            Vocab=hax.Axis(VOCAB, config.vocab_size),
            Mlp=hax.Axis(MLP, config.intermediate_size),
            KVHeads=hax.Axis(KV_HEADS, config.num_kv_heads),
            QPerKV=hax.Axis(Q_PER_KV, config.q_per_kv),
            HeadSize=hax.Axis(HEAD_SIZE, config.head_dim),
        )
