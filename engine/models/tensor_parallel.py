"""Which tensor-parallel widths a model can run at, and how its KV heads are laid out there: the one owner of
this rule (the head's validation, `pagefleet size`, `pagefleet check` and the weight loader all ask here). No JAX.

The engine shards attention by KV head and the MLP by its width over the mesh's `model` axis (T devices):

- T divides the KV heads: each device holds `kv_heads / T` KV heads and their query heads.
- T is a multiple of the KV heads and divides the attention heads: each KV head is replicated
  `T / kv_heads` times, as vLLM does, so each device holds one copy of one KV head and `heads / T` of its
  query heads. The model then runs as an equivalent one with `T` KV heads (`sharded_config`): query head h
  still reads the K and V of its original KV head, so the samples are those of one device.
- The MLP width must divide over T as well, and a mixture of experts' number of experts: each device holds
  `num_experts / T` whole experts (expert parallelism, engine/models/moe.py); a shared expert's width (Qwen2-MoE)
  is split as the dense MLP's.
"""

from __future__ import annotations

import dataclasses

from engine.models.model_config import ModelConfig


class MeshError(ValueError):
    """The model cannot be sharded over the mesh: a configuration error, the same on every try (never retried)."""


def tensor_parallel_error(cfg: ModelConfig, tp: int) -> str | None:
    """Why the model cannot be sharded over `tp` devices (one clause naming what does not divide), or None."""
    if tp < 1:
        return f"the tensor-parallel width must be at least 1, got {tp}"
    kv, heads = cfg.num_kv_heads, cfg.num_heads
    if kv % tp and (tp % kv or heads % tp):
        return (f"the model's {kv} KV heads and {heads} attention heads cannot be split over {tp} devices: choose a "
                f"width that divides the KV heads, or a multiple of them that divides the attention heads "
                f"(one of {valid_widths(cfg)})")
    if cfg.intermediate_size % tp:
        return (f"the model's MLP width {cfg.intermediate_size} does not divide over {tp} devices "
                f"(choose one of {valid_widths(cfg)})")
    if cfg.moe is not None and cfg.moe.shared_expert_size % tp:
        return (f"the model's shared expert MLP width {cfg.moe.shared_expert_size} does not divide over {tp} devices "
                f"(choose one of {valid_widths(cfg)})")
    if cfg.moe is not None and cfg.moe.num_experts % tp:
        return (f"the model's {cfg.moe.num_experts} experts do not divide over {tp} devices, each of which holds "
                f"whole experts (choose one of {valid_widths(cfg)})")
    return None


def valid_widths(cfg: ModelConfig) -> list[int]:
    """Every tensor-parallel width the model runs at, smallest first."""
    return [t for t in range(1, cfg.num_heads + 1)
            if (cfg.num_kv_heads % t == 0 or (t % cfg.num_kv_heads == 0 and cfg.num_heads % t == 0))
            and cfg.intermediate_size % t == 0
            and (cfg.moe is None or (cfg.moe.num_experts % t == 0 and cfg.moe.shared_expert_size % t == 0))]


def kv_replicas(cfg: ModelConfig, tp: int) -> int:
    """How many copies of each KV head the engine keeps at width `tp` (1 unless `tp` exceeds the KV heads)."""
    error = tensor_parallel_error(cfg, tp)
    if error is not None:
        raise MeshError(f"cluster.mesh.model={tp}: {error}")
    return tp // cfg.num_kv_heads if tp > cfg.num_kv_heads else 1


def sharded_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    """The model as the engine runs it at width `tp`: the same model with every KV head replicated
    `kv_replicas` times (KV head k' of it is KV head k' // replicas of the checkpoint). Its KV pool, K and V
    projections are what a device holds; query head h keeps its place (h = k' * q_per_kv' + g')."""
    replicas = kv_replicas(cfg, tp)
    return cfg if replicas == 1 else dataclasses.replace(cfg, num_kv_heads=cfg.num_kv_heads * replicas)
