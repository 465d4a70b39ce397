"""Read a Hugging Face safetensors checkpoint straight into the model's sharding.

Each parameter is built with `jax.make_array_from_callback`: every device reads only its own slice
from the memory-mapped files, so no host ever materialises a whole sharded tensor it does not hold.
Handles one `model.safetensors` or a sharded checkpoint with `model.safetensors.index.json`. Every part
read is checked for NaN/Inf (CheckpointError names the tensor and file); `engine.models.checkpoint_check` finds
missing, truncated and misshapen tensors from the headers before any of this runs.
"""

from __future__ import annotations

import json
import os
import struct
import time
from collections.abc import Callable
from pathlib import Path

import haliax as hax
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from haliax import Axis, NamedArray
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec as P, SingleDeviceSharding

from engine import ranged_file
import engine.files as files
from engine.models.axes import EXPERT_MLP, EXPERTS, ROUTES, SHARED_GATE, SHARED_MLP, TENSOR_PARALLEL, ModelAxes
from engine.models.checkpoint_check import CheckpointError, canonical_names, check_checkpoint
from engine.models.gemma_model import GemmaLayer, GemmaTransformer
from engine.models.model import Attention, DecoderLayer, Transformer
from engine.models.model_config import ModelConfig
from engine.models.moe import MoeMlp, SharedExpert
from engine.models.tensor_parallel import MeshError, kv_replicas, sharded_config

_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "F64": np.float64,
           "I64": np.int64, "I32": np.int32, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}


class SafetensorsCheckpoint:
    """The tensors of a checkpoint directory, by Hugging Face name: memory-mapped from a local directory, or read by
    byte ranges from an object store (`gs://...`, engine/ranged_file.py) with nothing copied to disk."""

    def __init__(self, path: str | os.PathLike, merge_gap: int = ranged_file.MERGE_GAP,
                 prefixes: tuple[tuple[str, str], ...] = ()) -> None:
        """`prefixes`: where the checkpoint may keep the engine's names instead (ModelConfig.weight_prefixes)."""
        root = str(path) if files.is_url(path) else Path(path)
        index = files.join(root, "model.safetensors.index.json")
        if files.exists(index):
            names = sorted(set(json.loads(files.read_text(index))["weight_map"].values()))
        elif files.exists(files.join(root, "model.safetensors")):
            names = ["model.safetensors"]
        else:
            raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {root}")
        self._tensors: dict[str, tuple[str | Path, str, tuple[int, ...], int]] = {}
        self._maps: dict[str | Path, np.ndarray] = {}
        self._remote: dict[str | Path, ranged_file.RangedFile] = {}
        for name in names:
            if not isinstance(name, str) or os.path.isabs(name) or ".." in Path(name).parts or "://" in name:
                raise CheckpointError(f"{index}: weight_map names the file {name!r}, which is not inside the model "
                                      "directory; shard files must be named relative to it (e.g. "
                                      "model-00001-of-00002.safetensors)")
            file = files.join(root, name)
            (header_len,) = struct.unpack("<Q", files.read_range(file, 0, 8))
            header = json.loads(files.read_range(file, 8, 8 + header_len))
            if files.is_url(file):
                self._remote[file] = ranged_file.RangedFile(str(file), merge_gap)
                self._maps[file] = self._remote[file].buffer
            for key, meta in header.items():
                if key == "__metadata__":
                    continue
                if meta["dtype"] not in _DTYPES:
                    raise ValueError(f"{file}: tensor {key} has unsupported dtype {meta['dtype']}")
                self._tensors[key] = (file, meta["dtype"], tuple(meta["shape"]), 8 + header_len + meta["data_offsets"][0])
        self._tensors = {ours: self._tensors[name] for ours, name in canonical_names(list(self._tensors), prefixes).items()}

    @property
    def bytes_read(self) -> int:
        """Bytes read from the object store so far (0 for a local checkpoint: it is memory-mapped)."""
        return sum(f.bytes_read for f in self._remote.values())

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def file_of(self, name: str) -> str | Path:
        return self._tensors[name][0]

    def finite(self, name: str, values: np.ndarray) -> np.ndarray:
        """`values` (read from tensor `name`) unchanged; raises CheckpointError naming the tensor and its file when
        they hold NaN or Inf, which would make every sample garbage (all-zero tokens, NaN logprobs)."""
        if (values.dtype.kind == "f" or values.dtype == ml_dtypes.bfloat16) and not np.isfinite(values).all():
            # Counted and located in the tensor as stored (its shape in the file), not in `values`, which may be
            # a device's transposed or reshaped part of it; the error path alone pays this pass.
            stored = np.asarray(self.get(name))
            bad = np.argwhere(~np.isfinite(stored))
            raise CheckpointError(f"{self.file_of(name)}: tensor {name} {list(stored.shape)} holds {len(bad):,} NaN or "
                                  f"Inf values (first at index {[int(i) for i in bad[0]]}); the checkpoint is corrupt: "
                                  "write or download it again")
        return values

    def read(self, name: str, select: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
        """`select(tensor)`, a view of tensor `name` (the part one device holds), read and checked finite. From an
        object store only the bytes of that view are fetched (those not fetched before)."""
        part = select(self.get(name))
        remote = self._remote.get(self.file_of(name))
        if remote is not None:
            remote.ensure(part)
        return self.finite(name, part)

    def get(self, name: str) -> np.ndarray:
        """The tensor as an array over the memory-mapped file or the object's buffer (no data is read: local
        pages are read once touched, remote bytes by `read`)."""
        if name not in self._tensors:
            raise KeyError(f"checkpoint has no tensor {name!r}")
        file, dtype, shape, offset = self._tensors[name]
        if file not in self._maps:
            self._maps[file] = np.memmap(file, dtype=np.uint8, mode="r")
        np_dtype = np.dtype(_DTYPES[dtype])
        count = int(np.prod(shape)) if shape else 1
        raw = self._maps[file][offset:offset + count * np_dtype.itemsize]
        return raw.view(np_dtype).reshape(shape)


def partition_spec(axes: tuple[hax.Axis, ...], mesh: Mesh | None) -> P:
    if mesh is None or mesh.shape.get("model", 1) == 1:
        return P()
    return P(*[TENSOR_PARALLEL.get(a.name) for a in axes])


def sharding(axes: tuple[hax.Axis, ...], mesh: Mesh | AbstractMesh | None) -> jax.sharding.Sharding:
    """Where a parameter of these axes lives: TENSOR_PARALLEL axes split over the mesh's `model` axis."""
    if mesh is None:  # this process's own device: jax.devices()[0] belongs to process 0 in a multi-process run
        return SingleDeviceSharding(jax.local_devices()[0])
    named = NamedSharding(mesh, partition_spec(axes, mesh))
    for a, name in zip(axes, named.spec):
        if name is not None and a.size % mesh.shape[name]:
            raise MeshError(f"axis {a.name} of size {a.size} cannot be split over mesh axis {name!r} of size "
                             f"{mesh.shape[name]}; choose cluster.mesh.model dividing the model's KV heads and MLP width, "
                             "or a multiple of the KV heads dividing the attention heads")
    return named


def _place(axes: tuple[hax.Axis, ...], read: Callable[[tuple[slice, ...]], np.ndarray], dtype, mesh: Mesh | None
           ) -> NamedArray:
    """Build a named array whose every shard is read by `read(index)` (index: a tuple of slices)."""
    shape = tuple(a.size for a in axes)
    array = jax.make_array_from_callback(shape, sharding(axes, mesh), lambda index: np.asarray(read(index), dtype=dtype))
    return hax.named(array, axes)


def load_transformer(path: str | os.PathLike, dtype=jnp.float32, mesh: Mesh | None = None,
                     config: ModelConfig | None = None, report: dict | None = None,
                     merge_gap: int = ranged_file.MERGE_GAP) -> Transformer:
    """Load a Llama/Mistral/Qwen2/Qwen3 checkpoint (a local directory or a `gs://` URL) into a `Transformer` (parameters
    in `dtype`). `report`, if given, receives `load_s` and `bytes_read` (from an object store; 0 locally);
    `merge_gap`: see engine/ranged_file.py. On a mesh whose `model` axis exceeds the KV heads, the K and V
    projections are read with each KV head replicated (`engine.models.tensor_parallel`): the Transformer's config is
    then `sharded_config`, with that many KV heads."""
    t0 = time.perf_counter()
    cfg = config or ModelConfig.from_pretrained(path)
    check_checkpoint(path, cfg)  # headers only: a missing, truncated or misshapen tensor is named before any read
    ckpt = SafetensorsCheckpoint(path, merge_gap, cfg.weight_prefixes)
    np_dtype = np.dtype(jnp.dtype(dtype))

    def one(name: str, axes, to_named: Callable[[np.ndarray], np.ndarray]) -> NamedArray:
        return _place(axes, lambda idx: ckpt.read(name, lambda w: to_named(w)[idx]), np_dtype, mesh)

    def stack(names: list[str], axes, to_named: Callable[[np.ndarray], np.ndarray]) -> NamedArray:
        """Tensors `names`, stacked on a leading axis; each device reads only its own ones' parts (one expert per
        tensor, as the Hub stores them, stacked at load: no second copy of the whole in host memory)."""
        def read(idx):
            return np.stack([ckpt.read(name, lambda w: to_named(w)[idx[1:]]) for name in names[idx[0]]])
        return _place(axes, read, np_dtype, mesh)

    def stacked(suffix: str, axes, to_named: Callable[[np.ndarray], np.ndarray]) -> NamedArray:
        """`model.layers.{i}.<suffix>` for every layer, stacked on a leading `layers` axis."""
        return stack([f"model.layers.{i}.{suffix}" for i in range(cfg.num_layers)], axes, to_named)

    if not cfg.tie_word_embeddings and "lm_head.weight" not in ckpt:
        raise ValueError(f"{path}: config.json says tie_word_embeddings=false but the checkpoint has no lm_head.weight")
    model = _build(cfg, one, stacked, _model_width(mesh), stack)  # every device's shard is read here
    if report is not None:
        report.update(load_s=time.perf_counter() - t0, bytes_read=ckpt.bytes_read)
    return model


def abstract_transformer(cfg: ModelConfig, dtype, mesh: Mesh | AbstractMesh | None) -> Transformer:
    """A `Transformer` of shapes, dtypes and shardings only (`jax.ShapeDtypeStruct` leaves, no weights), for
    tracing and lowering the step programs without the checkpoint (`engine/sizing/preflight.py`)."""
    def abstract(name: str, axes, to_named) -> NamedArray:
        shape = tuple(a.size for a in axes)
        return NamedArray(jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=sharding(axes, mesh)), axes)

    return _build(cfg, abstract, abstract, _model_width(mesh))


def _model_width(mesh: Mesh | AbstractMesh | None) -> int:
    return 1 if mesh is None else mesh.shape.get("model", 1)


def _build(checkpoint_cfg: ModelConfig, one: Callable, stacked: Callable, tp: int, stack: Callable | None = None
           ) -> Transformer | GemmaTransformer:
    """The model's parameters by Hugging Face name, axes and layout: `one(name, axes, to_named)` makes a
    parameter, `stacked(suffix, axes, to_named)` one stacked over layers (axes include `layers`), `stack(names, axes,
    to_named)` one of several tensors stacked (a layer's experts; default `one`, for shapes only). A mixture of
    experts' layers are one `DecoderLayer` each (sparse and dense layers differ), run unrolled. At a
    tensor-parallel width `tp` beyond the KV heads, K and V (and their biases) are read with each KV head
    repeated `kv_replicas` times; Q and O keep their head order, viewed as (replicated KV head, query in it)."""
    cfg, replicas = sharded_config(checkpoint_cfg, tp), kv_replicas(checkpoint_cfg, tp)
    ax = ModelAxes.of(cfg)
    L, E, V, M, KV, G, D = ax.Layers, ax.Embed, ax.Vocab, ax.Mlp, ax.KVHeads, ax.QPerKV, ax.HeadSize
    t = lambda w: w.T  # torch Linear stores [out, in]; we store [in, out...]
    shape = lambda *dims: (lambda w: w.T.reshape(*dims))
    bias = cfg.qkv_bias
    kv0 = checkpoint_cfg.num_kv_heads
    copies = lambda read, axis: (lambda w: np.repeat(read(w), replicas, axis=axis)) if replicas > 1 else read  # noqa: E731
    def attention(stacked: Callable, qk_norm: bool) -> Attention:
        return Attention(
            wq=stacked("self_attn.q_proj.weight", (L, E, KV, G, D), shape(E.size, KV.size, G.size, D.size)),
            wk=stacked("self_attn.k_proj.weight", (L, E, KV, D), copies(shape(E.size, kv0, D.size), 1)),
            wv=stacked("self_attn.v_proj.weight", (L, E, KV, D), copies(shape(E.size, kv0, D.size), 1)),
            wo=stacked("self_attn.o_proj.weight", (L, KV, G, D, E), shape(KV.size, G.size, D.size, E.size)),
            bq=stacked("self_attn.q_proj.bias", (L, KV, G, D), lambda b: b.reshape(KV.size, G.size, D.size)) if bias else None,
            bk=stacked("self_attn.k_proj.bias", (L, KV, D), copies(lambda b: b.reshape(kv0, D.size), 0)) if bias else None,
            bv=stacked("self_attn.v_proj.bias", (L, KV, D), copies(lambda b: b.reshape(kv0, D.size), 0)) if bias else None,
            q_norm=stacked("self_attn.q_norm.weight", (L, D), lambda w: w) if qk_norm else None,
            k_norm=stacked("self_attn.k_norm.weight", (L, D), lambda w: w) if qk_norm else None,
        )

    if cfg.style.gemma_norms:  # Gemma's layer keeps its QK-norm (a Gemma RMSNorm) itself
        return _build_gemma(cfg, one, stacked, attention(stacked, qk_norm=False))

    def layer(stacked: Callable, mlp: dict) -> DecoderLayer:
        return DecoderLayer(attn_norm=stacked("input_layernorm.weight", (L, E), lambda w: w),
                            attn=attention(stacked, cfg.qk_norm),
                            mlp_norm=stacked("post_attention_layernorm.weight", (L, E), lambda w: w), **mlp)

    def dense(stacked: Callable) -> dict:
        return dict(w_gate=stacked("mlp.gate_proj.weight", (L, E, M), t), w_up=stacked("mlp.up_proj.weight", (L, E, M), t),
                    w_down=stacked("mlp.down_proj.weight", (L, M, E), t))

    def experts(i: int) -> dict:
        moe, X, I = cfg.moe, Axis(EXPERTS, cfg.moe.num_experts), Axis(EXPERT_MLP, cfg.moe.expert_size)
        names = lambda which: [moe.expert_tensor(i, e, which) for e in range(X.size)]  # noqa: E731
        shared = None
        if moe.shared_expert_size:
            S, tensor = Axis(SHARED_MLP, moe.shared_expert_size), lambda which: moe.shared_tensor(i, which)  # noqa: E731
            shared = SharedExpert(w_gate=one(tensor(0), (E, S), t), w_up=one(tensor(1), (E, S), t),
                                  w_down=one(tensor(2), (S, E), t),
                                  gate=one(moe.shared_gate_tensor(i), (E, Axis(SHARED_GATE, 1)), t))
        return dict(w_gate=None, w_up=None, w_down=None, moe=MoeMlp(
            router=one(moe.router_tensor(i), (E, Axis(ROUTES, X.size)), t), w_gate=(stack or one)(names(0), (X, E, I), t),
            w_up=(stack or one)(names(1), (X, E, I), t), w_down=(stack or one)(names(2), (X, I, E), t), shared=shared))

    if cfg.moe is None:
        layers = layer(stacked, dense(stacked))
    else:  # layer i's own tensors: the `layers` axis dropped
        of = lambda i: (lambda suffix, axes, f: one(f"model.layers.{i}.{suffix}", axes[1:], f))  # noqa: E731
        layers = tuple(layer(of(i), experts(i) if cfg.moe.sparse_layers[i] else dense(of(i)))
                       for i in range(cfg.num_layers))
    return Transformer(
        config=cfg,
        embed=one("model.embed_tokens.weight", (V, E), lambda w: w),
        layers=layers,
        final_norm=one("model.norm.weight", (E,), lambda w: w),
        lm_head=None if cfg.tie_word_embeddings else one("lm_head.weight", (V, E), lambda w: w),
    )


def _build_gemma(cfg: ModelConfig, one: Callable, stacked: Callable, attn: Attention) -> GemmaTransformer:
    """Gemma's layer by Hugging Face name: its four norms (transformers' `post_attention_layernorm` is the norm on
    the attention's output; `pre_feedforward_layernorm` the one before the MLP) and Gemma 3's QK-norm."""
    ax = ModelAxes.of(cfg)
    L, E, V, M, D = ax.Layers, ax.Embed, ax.Vocab, ax.Mlp, ax.HeadSize
    t = lambda w: w.T  # noqa: E731
    norm = lambda suffix, axis=E: stacked(suffix, (L, axis), lambda w: w)  # noqa: E731
    qk = cfg.qk_norm
    layers = GemmaLayer(
        attn_norm=norm("input_layernorm.weight"),
        attn=attn,
        q_norm=norm("self_attn.q_norm.weight", D) if qk else None,
        k_norm=norm("self_attn.k_norm.weight", D) if qk else None,
        post_attn_norm=norm("post_attention_layernorm.weight"),
        mlp_norm=norm("pre_feedforward_layernorm.weight"),
        post_mlp_norm=norm("post_feedforward_layernorm.weight"),
        w_gate=stacked("mlp.gate_proj.weight", (L, E, M), t),
        w_up=stacked("mlp.up_proj.weight", (L, E, M), t),
        w_down=stacked("mlp.down_proj.weight", (L, M, E), t),
    )
    return GemmaTransformer(
        config=cfg,
        embed=one("model.embed_tokens.weight", (V, E), lambda w: w),
        layers=layers,
        final_norm=one("model.norm.weight", (E,), lambda w: w),
        lm_head=None if cfg.tie_word_embeddings else one("lm_head.weight", (V, E), lambda w: w),
    )
