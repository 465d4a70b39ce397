"""A checkpoint's faults found from its safetensors headers alone (never its tensors): fast enough for the head
to run before any slice starts, so that a bad checkpoint stops a run once, by name, instead of failing
every slice's start with a reshape or sharding message.

Checked: every file the checkpoint names exists, its header parses, and it is as long as its header says
(a truncated download or copy); every tensor the model loads is present with the shape `config.json` implies.
A shape that disagrees names the tensor, the file and the `config.json` field that sets that dimension
(`vocab_size` for the embedding's rows, `hidden_size`, ...). NaN/Inf values need the tensors themselves:
`engine.models.weights` checks them as it loads.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import engine.files as files
from engine.models.model_config import ModelConfig


class CheckpointError(ValueError):
    """The checkpoint cannot be loaded as `config.json` describes it; the message names the file, the tensor and
    the field. Deterministic: retrying or restarting a slice never helps."""


def read_header(file: str | Path) -> tuple[dict, int]:
    """(the safetensors header without `__metadata__`, the byte offset where tensor data starts) of a local file or
    an object (`gs://...`, two ranged reads); raises CheckpointError naming the file when the header is cut short
    or is not JSON."""
    try:
        size = files.file_size(file)
        raw_len = files.read_range(file, 0, 8)
        if len(raw_len) < 8:
            raise CheckpointError(f"{file}: truncated safetensors file ({size} bytes, no header); "
                                  "copy or download it again")
        (header_len,) = struct.unpack("<Q", raw_len)
        if 8 + header_len > size:
            raise CheckpointError(f"{file}: truncated safetensors file: its header alone claims {header_len:,} "
                                  f"bytes of {size:,}; copy or download it again")
        header = json.loads(files.read_range(file, 8, 8 + header_len))
    except FileNotFoundError:
        raise CheckpointError(f"{file} is missing: the checkpoint's index names it; copy or download it") from None
    except (UnicodeDecodeError, ValueError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"{file}: the safetensors header is not valid JSON ({e}); the file is corrupt") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{file}: the safetensors header is not a JSON object; the file is corrupt")
    header.pop("__metadata__", None)
    return header, 8 + header_len


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
    """Tensor name -> (Hugging Face shape, the config.json field behind each dimension) for every tensor the
    model loads."""
    e, v, m = cfg.hidden_size, cfg.vocab_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    q_f, kv_f = "num_attention_heads x head_dim", "num_key_value_heads x head_dim"
    shapes = {"model.embed_tokens.weight": ((v, e), ("vocab_size", "hidden_size")),
              "model.norm.weight": ((e,), ("hidden_size",))}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = ((v, e), ("vocab_size", "hidden_size"))
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        mlp = {p + "mlp.gate_proj.weight": ((m, e), ("intermediate_size", "hidden_size")),
               p + "mlp.up_proj.weight": ((m, e), ("intermediate_size", "hidden_size")),
               p + "mlp.down_proj.weight": ((e, m), ("hidden_size", "intermediate_size"))}
        if cfg.moe is not None and cfg.moe.sparse_layers[i]:
            mlp = _expert_shapes(cfg, i)
        shapes.update(mlp)
        shapes.update({
            p + "input_layernorm.weight": ((e,), ("hidden_size",)),
            p + "post_attention_layernorm.weight": ((e,), ("hidden_size",)),
            p + "self_attn.q_proj.weight": ((q, e), (q_f, "hidden_size")),
            p + "self_attn.k_proj.weight": ((kv, e), (kv_f, "hidden_size")),
            p + "self_attn.v_proj.weight": ((kv, e), (kv_f, "hidden_size")),
            p + "self_attn.o_proj.weight": ((e, q), ("hidden_size", q_f)),
        })
        if cfg.qkv_bias:
            shapes.update({p + "self_attn.q_proj.bias": ((q,), (q_f,)), p + "self_attn.k_proj.bias": ((kv,), (kv_f,)),
                           p + "self_attn.v_proj.bias": ((kv,), (kv_f,))})
        if cfg.style.gemma_norms:
            shapes.update({p + "pre_feedforward_layernorm.weight": ((e,), ("hidden_size",)),
                           p + "post_feedforward_layernorm.weight": ((e,), ("hidden_size",))})
        if cfg.qk_norm:
            shapes.update({p + "self_attn.q_norm.weight": ((cfg.head_dim,), ("head_dim",)),
                           p + "self_attn.k_norm.weight": ((cfg.head_dim,), ("head_dim",))})
    return shapes


def _expert_shapes(cfg: ModelConfig, layer: int) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
    """A mixture-of-experts layer's router and experts, one tensor per expert as the Hub stores them."""
    moe, e = cfg.moe, cfg.hidden_size
    experts, size = moe.fields
    shapes = {moe.router_tensor(layer): ((moe.num_experts, e), (experts, "hidden_size"))}
    for x in range(moe.num_experts):
        shapes.update({moe.expert_tensor(layer, x, 0): ((moe.expert_size, e), (size, "hidden_size")),
                       moe.expert_tensor(layer, x, 1): ((moe.expert_size, e), (size, "hidden_size")),
                       moe.expert_tensor(layer, x, 2): ((e, moe.expert_size), ("hidden_size", size))})
    if moe.shared_expert_size:
        s, field = moe.shared_expert_size, "shared_expert_intermediate_size"
        shapes.update({moe.shared_tensor(layer, 0): ((s, e), (field, "hidden_size")),
                       moe.shared_tensor(layer, 1): ((s, e), (field, "hidden_size")),
                       moe.shared_tensor(layer, 2): ((e, s), ("hidden_size", field)),
                       moe.shared_gate_tensor(layer): ((1, e), ("1", "hidden_size"))})
    return shapes


def canonical_names(stored: list[str], prefixes: tuple[tuple[str, str], ...]) -> dict[str, str]:
    """The engine's name of each stored tensor -> its name in the checkpoint: the name itself, and for each
    (engine prefix, stored prefix) of `prefixes` (ModelConfig.weight_prefixes) the stored name with the engine's
    prefix instead (a multimodal checkpoint's `model.language_model.layers.0...` is `model.layers.0...`)."""
    names = {name: name for name in stored}
    for ours, theirs in prefixes:
        for name in stored:
            if name.startswith(theirs):
                names.setdefault(ours + name[len(theirs):], name)
    return names


def checkpoint_files(root: str | Path) -> list[str | Path]:
    index = files.join(root, "model.safetensors.index.json")
    if files.exists(index):
        try:
            weight_map = json.loads(files.read_text(index))["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index} is not a safetensors index (a JSON object with weight_map): {e}") from None
        return [files.join(root, name) for name in sorted(set(weight_map.values()))]
    if files.exists(files.join(root, "model.safetensors")):
        return [files.join(root, "model.safetensors")]
    raise CheckpointError(f"no model.safetensors or model.safetensors.index.json in {root}")


def check_checkpoint(path: str | os.PathLike, config: ModelConfig | None = None) -> None:
    """Raise CheckpointError for the first fault the headers show (see the module docstring); reads no tensor."""
    root = str(path) if files.is_url(path) else Path(path)
    cfg = config or ModelConfig.from_pretrained(root)
    where: dict[str, tuple[str | Path, list[int]]] = {}
    for file in checkpoint_files(root):
        header, data_start = read_header(file)
        size = files.file_size(file)
        end = max((int(meta["data_offsets"][1]) for meta in header.values() if isinstance(meta, dict)
                   and "data_offsets" in meta), default=0)
        if data_start + end > size:
            raise CheckpointError(f"{file}: truncated safetensors file: {size:,} bytes, its header needs "
                                  f"{data_start + end:,}; copy or download it again")
        for name, meta in header.items():
            where[name] = (file, list(meta.get("shape", [])) if isinstance(meta, dict) else [])
    where = {ours: where[name] for ours, name in canonical_names(list(where), cfg.weight_prefixes).items()}
    for name, (shape, fields) in expected_shapes(cfg).items():
        if name not in where:
            raise CheckpointError(f"{root}: the checkpoint has no tensor {name}, which config.json "
                                  f"(model_type={cfg.model_type}) needs")
        file, got = where[name]
        if tuple(got) != shape:
            wrong = [f"{f}={want} but the tensor has {have}" for want, have, f in zip(shape, got, fields) if want != have]
            detail = "; ".join(wrong) if len(got) == len(shape) else f"expected {len(shape)} dimensions"
            raise CheckpointError(f"{file}: tensor {name} has shape {list(got)}, config.json implies {list(shape)} "
                                  f"({detail}); fix config.json or the checkpoint")
