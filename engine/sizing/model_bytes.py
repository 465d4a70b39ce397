"""What a model's weights and KV cache weigh, from its config alone: the one place for these formulas
(`pagefleet size`, `pagefleet check` and the engine's sizing for the machine all use them). No JAX here."""

from __future__ import annotations

from dataclasses import dataclass

from engine.models.model_config import ModelConfig

GiB = 2**30
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
"""Bytes per parameter and per KV element for each `model.dtype`."""


@dataclass(frozen=True)
class ParamCount:
    """Parameters split by how the engine places them on a tensor-parallel mesh."""

    replicated: int
    """Held whole by every chip: token embeddings, untied lm_head, RMSNorm weights."""
    sharded: int
    """Split over the `model` axis: q/k/v/o projections (and QKV biases) and the MLP."""

    @property
    def total(self) -> int:
        return self.replicated + self.sharded

    def per_chip(self, tp: int) -> int:
        return self.replicated + self.sharded // tp


def count_params(cfg: ModelConfig) -> ParamCount:
    """Parameters of the decoder from its config: Llama's layer (Llama, Mistral, Qwen2, Qwen3), Gemma's four norms,
    QK-norm, and the mixtures of experts Mixtral, Qwen3-MoE and Qwen2-MoE, whose every expert is held (spread whole
    over tp: num_experts / tp a chip, the router replicated; Qwen2-MoE's shared expert split as the dense MLP, its
    gate replicated). The final norm is the `hidden` replicated beside the layers'."""
    hidden, head_dim = cfg.hidden_size, cfg.head_dim
    q_out, kv_out = cfg.num_heads * head_dim, cfg.num_kv_heads * head_dim
    attention = hidden * q_out + 2 * hidden * kv_out + q_out * hidden  # q, k, v, o
    if cfg.qkv_bias:
        attention += q_out + 2 * kv_out
    dense_mlp = 3 * hidden * cfg.intermediate_size  # gate, up, down
    moe = cfg.moe
    sparse = sum(moe.sparse_layers) if moe else 0
    experts = moe.num_experts * 3 * hidden * moe.expert_size if moe else 0  # every expert's gate, up, down
    router = moe.num_experts * hidden if moe else 0  # replicated
    shared = 3 * hidden * moe.shared_expert_size if moe else 0  # Qwen2-MoE's shared expert: split as the dense MLP
    shared_gate = hidden if moe and moe.shared_expert_size else 0  # its gate: replicated
    norms_per_layer = (4 if cfg.style.gemma_norms else 2) * hidden  # input, post-attention (Gemma: and around the MLP)
    if cfg.qk_norm:
        norms_per_layer += 2 * head_dim
    embeddings = cfg.vocab_size * hidden * (1 if cfg.tie_word_embeddings else 2)
    return ParamCount(
        replicated=embeddings + cfg.num_layers * norms_per_layer + hidden + sparse * (router + shared_gate),
        sharded=cfg.num_layers * attention + (cfg.num_layers - sparse) * dense_mlp + sparse * (experts + shared),
    )


def kv_bytes_per_token(cfg: ModelConfig, dtype_bytes: int) -> int:
    """K and V of one token in every layer: 2 * layers * kv_heads * head_dim * dtype_bytes."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * dtype_bytes


def kv_page_bytes(cfg: ModelConfig, dtype_bytes: int, page_size: int, tp: int = 1) -> int:
    """One KV page (`page_size` tokens of every layer) on one device of a `model` axis `tp` wide; `cfg` as the engine
    holds it (`sharded_config`: KV heads replicated when tp exceeds them). A pool of P pages is P times this: the
    one formula `pagefleet size`, `pagefleet check` and the engine's sizing for the machine use."""
    return page_size * (kv_bytes_per_token(cfg, dtype_bytes) // tp)
