"""Gemma 2 and Gemma 3's decoder in haliax, over the same paged KV pool as the Llama decoder (engine/models/model.py),
whose attention, projections, RoPE and row tiles it reuses. What the family reads from config.json is in
engine/models/gemma.py; what it does differently is here:

- RMSNorm as x / rms(x) * (1 + weight), all in float32, then cast back (`gemma_rms_norm`);
- embeddings multiplied by sqrt(hidden_size), rounded to the weights' dtype first (as transformers does);
- four norms per layer: input, post-attention (on the attention's output, before the residual add), pre- and
  post-feedforward (around the MLP);
- a GeGLU MLP: the tanh GELU of the gate times the up projection;
- QK-norm (Gemma 3): a Gemma RMSNorm over each query and key head, before RoPE;
- per layer, full or sliding-window attention, with its own RoPE (Gemma 3: the sliding layers' base);
- logits soft-capped: C * tanh(z / C).

Layers of two attention kinds take different (static) kernel arguments, so the layers always run unrolled, one
per `GemmaLayer`; a stacked model is split first (`unstack_layers`).
"""

from __future__ import annotations

import equinox as eqx
import haliax as hax
import jax.numpy as jnp
import numpy as np
from haliax import NamedArray

from engine.device.row_tiles import by_named_rows, row_tile
from engine.device.step_inputs import StepInputs
from engine.models.axes import EMBED, HEAD_SIZE, TOKEN, ModelAxes
from engine.models.model import Attention, StepSettings, _attention, _qkv, mean_square, rope_tables, unstack_layers
from engine.models.model_config import ModelConfig


class GemmaLayer(eqx.Module):
    attn_norm: NamedArray  # [embed] input_layernorm
    attn: Attention
    q_norm: NamedArray | None  # [head_size] (Gemma 3)
    k_norm: NamedArray | None  # [head_size]
    post_attn_norm: NamedArray  # [embed] post_attention_layernorm: on the attention's output
    mlp_norm: NamedArray  # [embed] pre_feedforward_layernorm
    post_mlp_norm: NamedArray  # [embed] post_feedforward_layernorm
    w_gate: NamedArray  # [embed, mlp]
    w_up: NamedArray  # [embed, mlp]
    w_down: NamedArray  # [mlp, embed]


class GemmaTransformer(eqx.Module):
    config: ModelConfig = eqx.field(static=True)
    embed: NamedArray  # [vocab, embed]
    layers: GemmaLayer | tuple[GemmaLayer, ...]  # stacked (a leading `layers` axis), or one per layer
    final_norm: NamedArray  # [embed]
    lm_head: NamedArray | None  # [vocab, embed]; None when tied to `embed`

    @property
    def axes(self) -> ModelAxes:
        return ModelAxes.of(self.config)

    def __call__(self, kv_pool: NamedArray, inputs: StepInputs, settings: StepSettings
                 ) -> tuple[NamedArray, NamedArray]:
        """Returns the updated pool and logits [seq, vocab] (float32) of each sequence's last new token."""
        if not isinstance(self.layers, tuple):
            return unstack_layers(self)(kv_pool, inputs, settings)
        cfg, ax = self.config, self.axes
        eps = cfg.rms_norm_eps
        Token = hax.Axis(TOKEN, inputs.token_ids.shape[0])
        x = self.embed.take(ax.Vocab, hax.named(inputs.token_ids, Token))  # scaled in layer 0's row tiles (below)
        # transformers keeps sqrt(hidden_size) as a float32 tensor and casts it to the weights' dtype.
        scale = jnp.asarray(np.float32(cfg.hidden_size**0.5)).astype(x.dtype)
        tables = {False: rope_tables(cfg, inputs.positions)}
        if cfg.style.local_rope_theta is not None:
            tables[True] = rope_tables(cfg, inputs.positions, sliding=True)
        tile = row_tile(Token.size, settings.min_matmul_rows)
        num_tokens = inputs.cu_q_lens[-1]  # the step's real tokens; the rest pad it to its bucket

        def by_token_rows(f, *xs: NamedArray):
            return by_named_rows(f, tile, TOKEN, *xs, num_rows=num_tokens)

        for i, layer in enumerate(self.layers):
            def residual(x: NamedArray, i: int = i) -> NamedArray:
                """The residual stream entering layer i: layer 0 scales the embeddings inside each of its row tiles.
                A product computed outside them could be fused into the residual add after attention (one FMA, one
                rounding) in a step whose rows fill the tile exactly, and rounded first in a step padded to it, so
                a token's bits would depend on the step's size."""
                return x * scale if i == 0 else x

            def qkv(x: NamedArray, layer: GemmaLayer = layer):
                q, k, v = _qkv(layer.attn, gemma_rms_norm(residual(x), layer.attn_norm, eps), ax)
                if layer.q_norm is not None:
                    q, k = gemma_rms_norm(q, layer.q_norm, eps, HEAD_SIZE), gemma_rms_norm(k, layer.k_norm, eps, HEAD_SIZE)
                return q, k, v

            def out_and_mlp(x: NamedArray, attn: NamedArray, layer: GemmaLayer = layer) -> NamedArray:
                out = hax.dot(attn, layer.attn.wo, axis=(ax.KVHeads, ax.QPerKV, ax.HeadSize))
                x = residual(x) + gemma_rms_norm(out, layer.post_attn_norm, eps)
                h = gemma_rms_norm(x, layer.mlp_norm, eps)
                gate = hax.dot(h, layer.w_gate, axis=ax.Embed)
                up = hax.dot(h, layer.w_up, axis=ax.Embed)
                down = hax.dot(hax.nn.gelu(gate, approximate=True) * up, layer.w_down, axis=ax.Mlp)
                return x + gemma_rms_norm(down, layer.post_mlp_norm, eps)

            q, k, v = by_token_rows(qkv, x)
            cos, sin = tables[cfg.is_sliding(i) and cfg.style.local_rope_theta is not None]
            attn, kv_pool = _attention(q, k, v, kv_pool, jnp.int32(i), cos, sin, inputs, cfg, ax, settings,
                                       cfg.layer_window(i))
            x = by_token_rows(out_and_mlp, x, attn)

        Seq = hax.Axis("seq", inputs.logits_indices.shape[0])
        last = x.take(Token, hax.named(inputs.logits_indices, Seq))
        head = self.embed if self.lm_head is None else self.lm_head
        cap = cfg.style.final_logit_softcap

        def lm_head(last: NamedArray) -> NamedArray:
            last = gemma_rms_norm(last, self.final_norm, eps)
            logits = hax.dot(last, head, axis=ax.Embed, preferred_element_type=jnp.float32).astype(jnp.float32)
            return logits if cap is None else cap * hax.tanh(logits / cap)

        return kv_pool, by_named_rows(lm_head, row_tile(Seq.size, settings.min_matmul_rows), "seq",
                                      last).rearrange((Seq, ax.Vocab))


def gemma_rms_norm(x: NamedArray, weight: NamedArray, eps: float, axis: str = EMBED) -> NamedArray:
    """transformers' Gemma RMSNorm over `axis`: x / rms(x) * (1 + weight), all in float32, then cast to x's dtype."""
    x32 = x.astype(jnp.float32)
    variance = mean_square(x32, axis)
    return (x32 * hax.rsqrt(variance + eps) * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)
