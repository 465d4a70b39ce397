"""Llama-family decoder (Llama 2/3/3.1, Mistral, Qwen2, Qwen3) in haliax, over a paged KV pool.

Parameters are named arrays; the layers are stacked on a `layers` axis and scanned (on a CPU, unstacked and
unrolled: `unstack_layers`). The forward
pass is pure: `(params, kv_pool, StepInputs) -> (kv_pool, logits of each sequence's last new token)`.
Norms, RoPE and attention run in float32; matmuls in the parameters' dtype (float32 or bfloat16).
"""

from __future__ import annotations

from dataclasses import dataclass

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
from haliax import NamedArray
from jax.sharding import Mesh, PartitionSpec as P

from engine.kernels import cpu_attention
from engine.kernels.attention import ragged_paged_attention, write_kv
from engine.models.axes import EMBED, HEAD_SIZE, KV_COMBINED, PAGE, PAGE_SLOT, TOKEN, ModelAxes
from engine.models.model_config import ModelConfig
from engine.models.moe import MoeMlp, moe_mlp, shared_expert
from engine.device.row_tiles import by_named_rows, ordered_sum, row_tile
from engine.device.step_inputs import StepInputs


@dataclass(frozen=True)
class StepSettings:
    """Static (compile-time) choices of a step program's forward pass and sampling: the attention kernel and its
    blocks, the mesh, and the row tiles of its matmuls and of its sampler."""

    impl: str  # "reference" | "pallas_tpu"
    pages_per_block: int
    queries_per_block: int
    num_pages: int  # units (engine/kv/kv_groups.py); slot s of every unit: pool rows [s, s + 1) * num_pages
    mesh: Mesh | None = None  # when it has several devices, attention runs per device (per KV-head shard over `model`)
    tiles_per_group: int = 8  # query tiles the reference attention moves through the KV blocks together
    # Fewest rows per matmul (0: no rule). XLA's CPU matmuls pick their kernel by row count: calls of 2-32 rows
    # round a row differently from calls of 64 or more, which agree with each other. Row-wise layers
    # (projections, MLP, LM head) therefore run on tiles of at least this many rows (and at most
    # `row_tiles.MAX_TILE`), so a row's bits never depend on how many rows share the step.
    min_matmul_rows: int = 0
    sample_row_tile: int = 0  # rows of each tile of sampling (softmax, top-p over the vocab), exactly; 0: no tiles
    # Each layer's KV layer group (whose page table it reads) and slot in that group's units (KVGroups); empty: one
    # group, layer l at slot l.
    layer_group: tuple[int, ...] = ()
    layer_slot: tuple[int, ...] = ()

    @property
    def num_groups(self) -> int:
        """Page tables a step reads (StepInputs' G)."""
        return max(self.layer_group, default=0) + 1

    def layer_table(self, layer: jax.Array | int) -> tuple[jax.Array | int, jax.Array]:
        """The group whose page table and slots layer `layer` (traced in a scan, or a constant) reads, and the
        offset of its slot's rows in the pool, in units."""
        if not self.layer_group:
            return 0, layer * self.num_pages
        group = jnp.asarray(self.layer_group, jnp.int32)[layer]
        return group, jnp.asarray(self.layer_slot, jnp.int32)[layer] * self.num_pages


class Attention(eqx.Module):
    wq: NamedArray  # [embed, kv_heads, q_per_kv, head_size]
    wk: NamedArray  # [embed, kv_heads, head_size]
    wv: NamedArray  # [embed, kv_heads, head_size]
    wo: NamedArray  # [kv_heads, q_per_kv, head_size, embed]
    bq: NamedArray | None  # [kv_heads, q_per_kv, head_size] (Qwen2)
    bk: NamedArray | None  # [kv_heads, head_size]
    bv: NamedArray | None  # [kv_heads, head_size]
    q_norm: NamedArray | None = None  # [head_size] (Qwen3's QK-norm)
    k_norm: NamedArray | None = None  # [head_size]


class DecoderLayer(eqx.Module):
    attn_norm: NamedArray  # [embed]
    attn: Attention
    mlp_norm: NamedArray  # [embed]
    w_gate: NamedArray | None  # [embed, mlp]; None in a mixture-of-experts layer
    w_up: NamedArray | None  # [embed, mlp]
    w_down: NamedArray | None  # [mlp, embed]
    moe: MoeMlp | None = None  # the experts of a mixture-of-experts layer (engine/models/moe.py)


class Transformer(eqx.Module):
    config: ModelConfig = eqx.field(static=True)
    embed: NamedArray  # [vocab, embed]
    layers: DecoderLayer | tuple[DecoderLayer, ...]  # stacked (every leaf with a leading `layers` axis), or one per layer
    final_norm: NamedArray  # [embed]
    lm_head: NamedArray | None  # [vocab, embed]; None when tied to `embed`

    @property
    def axes(self) -> ModelAxes:
        return ModelAxes.of(self.config)

    def __call__(self, kv_pool: NamedArray, inputs: StepInputs, settings: StepSettings
                 ) -> tuple[NamedArray, NamedArray]:
        """Returns the updated pool and logits [seq, vocab] (float32) of each sequence's last new token."""
        cfg, ax = self.config, self.axes
        Token = hax.Axis(TOKEN, inputs.token_ids.shape[0])
        x = self.embed.take(ax.Vocab, hax.named(inputs.token_ids, Token))
        cos, sin = rope_tables(cfg, inputs.positions)
        tile = row_tile(Token.size, settings.min_matmul_rows)
        num_tokens = inputs.cu_q_lens[-1]  # the step's real tokens; the rest pad it to its bucket

        def by_token_rows(f, *xs: NamedArray):
            return by_named_rows(f, tile, TOKEN, *xs, num_rows=num_tokens)

        def layer_step(carry, layer: DecoderLayer, layer_index: NamedArray):
            x, pool = carry
            q, k, v = by_token_rows(lambda x: _qk_norm(layer.attn, *_qkv(layer.attn, rms_norm(
                x, layer.attn_norm, cfg.rms_norm_eps), ax), cfg.rms_norm_eps), x)
            attn, pool = _attention(q, k, v, pool, layer_index.array, cos, sin, inputs, cfg, ax, settings,
                                    cfg.sliding_window)

            def out_and_norm(x: NamedArray, attn: NamedArray) -> tuple[NamedArray, NamedArray]:
                x = x + hax.dot(attn, layer.attn.wo, axis=(ax.KVHeads, ax.QPerKV, ax.HeadSize))
                return x, rms_norm(x, layer.mlp_norm, cfg.rms_norm_eps)

            if layer.moe is not None:
                # Expert tiles on the CPU (ragged_dot elsewhere) over the whole step's rows, not a row tile's: an
                # expert's rows then fill larger matmuls, and a row's bits are the same (its expert matmuls have the
                # row counts of its kind, prompt or generated token, whoever shares them).
                x, h = by_token_rows(out_and_norm, x, attn)
                mlp = moe_mlp(h, layer.moe, cfg.moe, settings.min_matmul_rows, num_tokens, settings.mesh,
                              inputs.generated, native=settings.impl == "cpu_kernel")
                if layer.moe.shared is not None:  # Qwen2-MoE: in row tiles, as the dense MLP
                    mlp = mlp + by_token_rows(lambda h: shared_expert(h, layer.moe.shared), h)
                return (x + mlp, pool), None

            def out_and_mlp(x: NamedArray, attn: NamedArray) -> NamedArray:
                x, h = out_and_norm(x, attn)
                gate = hax.dot(h, layer.w_gate, axis=ax.Embed)
                up = hax.dot(h, layer.w_up, axis=ax.Embed)
                return x + hax.dot(hax.nn.silu(gate) * up, layer.w_down, axis=ax.Mlp)

            return (by_token_rows(out_and_mlp, x, attn), pool), None

        if isinstance(self.layers, tuple):  # unrolled (unstack_layers)
            for i, layer in enumerate(self.layers):
                (x, kv_pool), _ = layer_step((x, kv_pool), layer, hax.named(jnp.int32(i), ()))
        else:
            (x, kv_pool), _ = hax.scan(layer_step, ax.Layers)((x, kv_pool), self.layers, hax.arange(ax.Layers))
        Seq = hax.Axis("seq", inputs.logits_indices.shape[0])
        last = x.take(Token, hax.named(inputs.logits_indices, Seq))
        head = self.embed if self.lm_head is None else self.lm_head

        def lm_head(last: NamedArray) -> NamedArray:
            last = rms_norm(last, self.final_norm, cfg.rms_norm_eps)
            return hax.dot(last, head, axis=ax.Embed, preferred_element_type=jnp.float32).astype(jnp.float32)

        return kv_pool, by_named_rows(lm_head, row_tile(Seq.size, settings.min_matmul_rows), "seq",
                                      last).rearrange((Seq, ax.Vocab))


def unstack_layers(model: Transformer) -> Transformer:
    """`model` with its stacked layers split into one `DecoderLayer` per layer, which the forward pass runs as an
    unrolled loop. For the CPU: there a scan over stacked layers copies each layer's weights out of the stack
    before its matmuls (XLA's CPU matmuls cannot read a slice of a buffer in place), so every forward pass copied
    every weight: a fifth of a 64-row decode step of llama-40m. Unrolled, a program takes about twice as long to
    compile, and XLA may fuse it differently, so logits can differ from the scanned program's in the last bits
    (4e-5 on llama-40m); every CPU program is unrolled, so no step mixes the two."""
    if isinstance(model.layers, tuple):
        return model
    is_named = lambda a: isinstance(a, NamedArray)  # noqa: E731
    layers = tuple(jax.tree.map(lambda a: hax.named(a.array[i], a.axes[1:]), model.layers, is_leaf=is_named)
                   for i in range(model.config.num_layers))
    return eqx.tree_at(lambda m: m.layers, model, layers)


def mean_square(x32: NamedArray, axis: str) -> NamedArray:
    """The mean of x² over `axis` (an RMSNorm's variance), in float32: over a head (`HEAD_SIZE`, QK-norm) in a
    fixed order (row_tiles.ordered_sum), whose bits do not depend on the step's rows; over the model's width with
    `hax.mean`, which is row-independent there."""
    if axis == HEAD_SIZE:
        return ordered_sum(x32 * x32, axis) / np.float32(x32.axis_size(axis))
    return hax.mean(x32 * x32, axis=axis)


def rms_norm(x: NamedArray, weight: NamedArray, eps: float, axis: str = EMBED) -> NamedArray:
    """Hugging Face's RMSNorm over `axis`: normalise in float32, cast back, then scale."""
    x32 = x.astype(jnp.float32)
    variance = mean_square(x32, axis)
    return weight * (x32 * hax.rsqrt(variance + eps)).astype(x.dtype)


def rope_tables(cfg: ModelConfig, positions: jax.Array, sliding: bool = False) -> tuple[jax.Array, jax.Array]:
    """cos, sin: f32[T, head_dim] in Hugging Face's rotate-half layout (the frequencies repeated twice); `sliding`:
    those of the sliding-window layers (ModelConfig.rope_inv_freq)."""
    inv_freq = jnp.asarray(np.asarray(cfg.rope_inv_freq(sliding), np.float32))  # f32[head_dim / 2]
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def _rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x: [T, heads..., head_dim]; rotate-half RoPE in float32, cast back to x's dtype."""
    extra = (None,) * (x.ndim - 2)
    c, s = cos[(slice(None),) + extra], sin[(slice(None),) + extra]
    x32 = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    return (x32 * c + rotated * s).astype(x.dtype)


def _qkv(attn: Attention, h: NamedArray, ax: ModelAxes) -> tuple[NamedArray, NamedArray, NamedArray]:
    q = hax.dot(h, attn.wq, axis=ax.Embed)
    k = hax.dot(h, attn.wk, axis=ax.Embed)
    v = hax.dot(h, attn.wv, axis=ax.Embed)
    if attn.bq is not None:
        q, k, v = q + attn.bq, k + attn.bk, v + attn.bv
    return q, k, v


def _qk_norm(attn: Attention, q: NamedArray, k: NamedArray, v: NamedArray, eps: float
             ) -> tuple[NamedArray, NamedArray, NamedArray]:
    """Qwen3's QK-norm: an RMSNorm over each query and key head (before RoPE); q, k, v unchanged without it."""
    if attn.q_norm is None:
        return q, k, v
    return rms_norm(q, attn.q_norm, eps, HEAD_SIZE), rms_norm(k, attn.k_norm, eps, HEAD_SIZE), v


def _attention(q: NamedArray, k: NamedArray, v: NamedArray, pool: NamedArray, layer: jax.Array, cos, sin,
               inputs: StepInputs, cfg: ModelConfig, ax: ModelAxes, settings: StepSettings, window: int | None
               ) -> tuple[NamedArray, NamedArray]:
    """Attention outputs [token, kv_heads, q_per_kv, head_size] (before `wo`) and the pool with this step's KV;
    queries see `window` tokens back (None: all), scores scaled by `cfg.attn_scale` and soft-capped as the
    family says."""
    Token = q.resolve_axis(TOKEN)
    q = q.rearrange((Token, ax.KVHeads, ax.QPerKV, ax.HeadSize)).array
    q = q.reshape(Token.size, cfg.num_heads, cfg.head_dim)  # [T, H, d]; head = kv_head * q_per_kv + g
    k = k.rearrange((Token, ax.KVHeads, ax.HeadSize)).array  # [T, kvh, d]
    v = v.rearrange((Token, ax.KVHeads, ax.HeadSize)).array  # [T, kvh, d]
    # With the native CPU kernel, RoPE runs in its library too (cpu_attention.rope): XLA would recompute the
    # rotation inside the fusion that writes K to the pool and contract a product into an FMA there in some steps
    # and not in others, so a position's K would depend on the step that computed it.
    native_rope = settings.impl == "cpu_kernel"
    if not native_rope:
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)

    # This layer reads its group's page table, at its slot's offset in the one pool shared by all layers.
    group, page_offset = settings.layer_table(layer)
    slot_mapping = inputs.slot_mapping[group]
    slots = jnp.where(slot_mapping < settings.num_pages * pool.axis_size(PAGE_SLOT),
                      slot_mapping + page_offset * pool.axis_size(PAGE_SLOT), jnp.iinfo(jnp.int32).max)
    pages = inputs.page_indices[group] + page_offset

    def attend(q, k, v, kv, slots, kv_lens, pages, cu_q_lens, num_seqs, cos, sin):
        if native_rope:
            q, k = cpu_attention.rope(q, cos, sin).astype(q.dtype), cpu_attention.rope(k, cos, sin).astype(k.dtype)
        kv = write_kv(kv, k, v, slots)
        out = ragged_paged_attention(
            q, kv, kv_lens, pages, cu_q_lens, num_seqs, sm_scale=cfg.attn_scale, sliding_window=window,
            soft_cap=cfg.style.attn_logit_softcap, impl=settings.impl, pages_per_block=settings.pages_per_block,
            queries_per_block=settings.queries_per_block, tiles_per_group=settings.tiles_per_group)
        return out, kv

    mesh = settings.mesh
    # Per device whenever the mesh has several (a multi-host slice at `model: 1` too): the Pallas kernel is a
    # Mosaic call, which XLA cannot partition itself; over `data` the devices hold the same rows (replicated).
    if mesh is not None and mesh.size > 1:
        heads, rep = P(None, "model", None), P()
        attend = jax.shard_map(attend, mesh=mesh,
                               in_specs=(heads, heads, heads, P(None, None, "model", None), rep, rep, rep, rep, rep,
                                         rep, rep),
                               out_specs=(heads, P(None, None, "model", None)), check_vma=False)
    out, kv = attend(q, k, v, pool.array, slots, inputs.kv_lens, pages, inputs.cu_q_lens, inputs.num_seqs, cos, sin)
    out = hax.named(out.reshape(Token.size, cfg.num_kv_heads, cfg.q_per_kv, cfg.head_dim),
                    (Token, ax.KVHeads, ax.QPerKV, ax.HeadSize))
    return out, hax.named(kv, pool.axes)


def kv_pool_axes(cfg: ModelConfig, num_pages: int, page_size: int, layers_per_unit: int | None = None
                 ) -> tuple[hax.Axis, ...]:
    """The pool holds every layer's pages: [layers_per_unit * num_pages, page_size, 2 * kv_heads, head_dim], in
    `num_pages` units of `layers_per_unit` layers (KVGroups; default: pages of every layer)."""
    return (hax.Axis(PAGE, (layers_per_unit or cfg.num_layers) * num_pages), hax.Axis(PAGE_SLOT, page_size),
            hax.Axis(KV_COMBINED, 2 * cfg.num_kv_heads), hax.Axis(HEAD_SIZE, cfg.head_dim))
