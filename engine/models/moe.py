"""The mixture-of-experts MLP (Mixtral, Qwen3-MoE): a router picks each token's top-k experts, the tokens are grouped
by expert, and each expert multiplies only its own tokens (a grouped matmul); each token's output is the sum of its
experts' outputs weighted by the router (engine/models/moe_config.py says how each family weighs them).

The grouped matmul has two forms, one result (within float32 rounding):
- `jax.lax.ragged_dot` over the pairs sorted by expert (`expert_tile_rows` 0): the shape TPU and GPU grouped-matmul
  kernels take;
- expert tiles (`expert_tile_rows` > 0, on the CPU): XLA's CPU backend lowers `ragged_dot` as a dense pass of every
  expert over every row with a mask (E times the work), and its matmuls round a row by the call's row count below 64
  rows (engine/device/row_tiles.py). So a row's pairs go by the row's kind, which is the token's own, not the
  step's:
  - a prompt token's pairs: each expert's padded to whole granules of half `expert_tile_rows` rows (at least that
    many), run as matmuls of 1 to 4 tiles of the expert's own weights, an expert at a time, experts with no pair
    skipped (`_tiled_grouped_mlp`): matmuls of at least 64 rows, whose bits do not depend on their row count;
  - a generated token's pairs (the engine sampled the token; its position is past its sequence's prompt): with the
    native CPU kernels (`native`: the step's attention runs in them), in the library's own grouped matmul
    (cpu_attention.moe_experts), which reads each expert's weights in place once for up to 16 of its pairs and sums
    every output element in one fixed order; without them, each expert's pairs in XLA matmuls of exactly
    GENERATED_TILE_ROWS rows (`_small_tiled_mlp`). A decode step's 64 rows bring each of 32 experts ~4 pairs:
    padding each to 64 rows did ~15x the work of the dense MLP of the same active size, and XLA copies an expert's
    weights out of the stacked array before its matmuls (as long as the matmuls, at 8 rows). Either way a
    generated token's bits do not depend on the pairs beside it, so it has the same bits in a decode step and
    when a preempted sequence recomputes it in a prompt step, and prefix-cached pages hold prompt tokens only.
  The router's matmul is narrow and rounds by the row count even past 64, so it runs on tiles of exactly
  `expert_tile_rows` rows.

The engine calls it once for a step's rows (not per row tile of the layer's other matmuls), so that an expert's rows
fill large matmuls; the step's padding rows go to no expert.

Expert parallelism: on a mesh whose `model` axis has T devices, each device holds num_experts / T whole experts
(engine/models/axes.py). Every device routes every row (the rows and the router are replicated), runs only its own
experts' pairs, and the pairs' outputs are summed over `model`: each pair's output is nonzero on one device only, so
the sum is exact and a row's output has the bits it has on one device (its experts' matmuls are the same matmuls;
the router's weighting and the sum over a row's experts run after, on every device alike). The sum moves k outputs
a row, k times the all-reduce of a tensor-parallel MLP: the price of those bits.
"""

from __future__ import annotations

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
from haliax import NamedArray
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from engine.device.row_tiles import by_row_tiles
from engine.kernels import cpu_attention
from engine.models.axes import EMBED, SHARED_GATE, SHARED_MLP
from engine.models.moe_config import MoeConfig


class SharedExpert(eqx.Module):
    """Qwen2-MoE's shared expert: a SwiGLU MLP every token runs, times a sigmoid gate, added to the experts' output."""
    w_gate: NamedArray  # [embed, shared_mlp]
    w_up: NamedArray  # [embed, shared_mlp]
    w_down: NamedArray  # [shared_mlp, embed]
    gate: NamedArray  # [embed, shared_gate]: one output


class MoeMlp(eqx.Module):
    router: NamedArray  # [embed, routes]
    w_gate: NamedArray  # [experts, embed, expert_mlp]
    w_up: NamedArray  # [experts, embed, expert_mlp]
    w_down: NamedArray  # [experts, expert_mlp, embed]
    shared: SharedExpert | None = None


def shared_expert(h: NamedArray, shared: SharedExpert) -> NamedArray:
    """The shared expert's gated output for rows `h` [..., embed], as transformers' Qwen2MoeSparseMoeBlock computes
    it: sigmoid(h @ gate) * down(silu(h @ w_gate) * (h @ w_up)). Split over `model` by its width, as the dense MLP."""
    y = hax.dot(hax.nn.silu(hax.dot(h, shared.w_gate, axis=EMBED)) * hax.dot(h, shared.w_up, axis=EMBED),
                shared.w_down, axis=SHARED_MLP)
    return hax.nn.sigmoid(hax.dot(h, shared.gate, axis=EMBED))[SHARED_GATE, 0] * y


def moe_mlp(h: NamedArray, moe: MoeMlp, cfg: MoeConfig, expert_tile_rows: int,
            num_rows: jax.Array | None = None, mesh: Mesh | None = None,
            generated: jax.Array | None = None, native: bool = False) -> NamedArray:
    """The MLP's output for rows `h` [..., embed] (each row's own experts, router-weighted), same axes as `h`.
    `num_rows` (a traced int, with expert tiles): only the rows below it matter; the experts skip the others, whose
    outputs are zeros. `mesh`: with several devices over `model`, the experts are spread over them (module doc).
    `generated` (bool, one per row, with expert tiles): the rows that are generated tokens (module doc); None: none.
    `native`: the native CPU kernels are loaded (module doc); they take float32 only."""
    rows_axes = tuple(a for a in h.axes if a.name != EMBED)
    x = h.rearrange((*rows_axes, h.resolve_axis(EMBED))).array
    x = x.reshape(-1, x.shape[-1])  # [R, H]
    weights = tuple(w.array for w in (moe.router, moe.w_gate, moe.w_up, moe.w_down))
    if generated is None:
        generated = jnp.zeros(x.shape[0], bool)
    if mesh is not None and mesh.shape.get("model", 1) > 1:
        def rows(x, generated, router, w_gate, w_up, w_down, *num_rows):
            return _moe_rows(x, router, w_gate, w_up, w_down, cfg, expert_tile_rows, *num_rows, expert_axis="model",
                             generated=generated, native=native)

        experts, rep = P("model", None, None), P()
        extra = () if num_rows is None else (num_rows,)
        out = jax.shard_map(rows, mesh=mesh, in_specs=(rep, rep, rep, experts, experts, experts,
                                                       *(rep for _ in extra)),
                            out_specs=rep, check_vma=False)(x, generated.reshape(-1), *weights, *extra)
    else:
        out = _moe_rows(x, *weights, cfg, expert_tile_rows, num_rows, generated=generated.reshape(-1), native=native)
    return hax.named(out.reshape(*(a.size for a in rows_axes), x.shape[-1]), (*rows_axes, h.resolve_axis(EMBED)))


def route(x: jax.Array, router: jax.Array, cfg: MoeConfig) -> tuple[jax.Array, jax.Array]:
    """Each row's top-k experts i32[R, k] (ascending) and their weights f32[R, k]: the softmax over every expert in
    float32, the top k, renormalized to sum to one when the family says so."""
    logits = jnp.dot(x, router, preferred_element_type=jnp.float32).astype(x.dtype)  # [R, E]
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, cfg.top_k)
    if cfg.renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    order = jnp.argsort(experts, axis=-1)  # sum each row's experts in expert order, as transformers adds them
    return jnp.take_along_axis(experts, order, -1), jnp.take_along_axis(weights, order, -1)


def _expert(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array) -> jax.Array:  # noqa: D103
    """One expert's SwiGLU on its rows x [rows, H]."""
    return jnp.dot(jax.nn.silu(jnp.dot(x, w_gate)) * jnp.dot(x, w_up), w_down)


def _moe_rows(x: jax.Array, router: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array,
              cfg: MoeConfig, tile: int, num_rows: jax.Array | None = None, expert_axis: str | None = None,
              generated: jax.Array | None = None, native: bool = False) -> jax.Array:
    """x [R, H]; router [H, E]; w_gate, w_up [E', H, I]; w_down [E', I, H]: every expert (E' = E), or, inside a
    shard_map over `expert_axis`, this device's E' = E / T of them (module doc). `num_rows`, `generated` (bool[R] or
    None), `native`: see moe_mlp."""
    R, H = x.shape
    k, local = cfg.top_k, w_gate.shape[0]
    # The router's matmul is narrow (E columns): XLA's CPU kernels round it by the call's row count even past 64
    # rows, so on the CPU it runs on tiles of exactly `tile` rows too.
    experts, weights = by_row_tiles(lambda x: route(x, router, cfg), tile, x, num_rows=num_rows)
    pair_expert = experts.reshape(-1)  # [P]: pair p is row p // k, its (p % k)-th expert
    if expert_axis is not None:  # this device's experts by local index; another device's: none (local)
        pair_expert = pair_expert - jax.lax.axis_index(expert_axis) * local
        pair_expert = jnp.where((pair_expert >= 0) & (pair_expert < local), pair_expert, local)
    if tile and num_rows is not None:  # the rows past num_rows go to no expert (local: past every group, not counted)
        pair_expert = jnp.where(jnp.arange(R * k) // k < num_rows, pair_expert, local)
    if tile:
        w = (w_gate, w_up, w_down)
        if native and all(a.dtype == jnp.float32 for a in (x, *w)):
            generated_mlp = lambda x, k, pair_expert, w: cpu_attention.moe_experts(x, pair_expert, *w)  # noqa: E731
        else:
            generated_mlp = _small_tiled_mlp
        gen = jnp.zeros(R * k, bool) if generated is None else jnp.repeat(generated, k)
        # Each pair goes by its row's kind (module doc); a kind with no pair in the step costs nothing.
        prompt_expert, gen_expert = jnp.where(gen, local, pair_expert), jnp.where(gen, pair_expert, local)
        none = lambda: jnp.zeros((R * k, H), x.dtype)  # noqa: E731
        y = jnp.where(gen[:, None],
                      jax.lax.cond(jnp.any(gen_expert < local), lambda: generated_mlp(x, k, gen_expert, w), none),
                      jax.lax.cond(jnp.any(prompt_expert < local),
                                   lambda: _tiled_grouped_mlp(x, k, prompt_expert, w, tile), none))
    else:
        order = jnp.argsort(pair_expert, stable=True)  # pairs grouped by expert, rows in order within one
        counts = jnp.bincount(pair_expert, length=local)  # i32[E'] (no expert is not counted)
        rows_sorted = x[order // k]  # [P, H]
        gate = jax.lax.ragged_dot(rows_sorted, w_gate, counts)
        up = jax.lax.ragged_dot(rows_sorted, w_up, counts)
        y_sorted = jax.lax.ragged_dot(jax.nn.silu(gate) * up, w_down, counts)
        y_sorted = jnp.where((pair_expert[order] < local)[:, None], y_sorted, 0)  # pairs of no expert here: zeros
        y = jnp.zeros_like(y_sorted).at[order].set(y_sorted)  # back to pair order
    y = y.reshape(R, k, H)
    if expert_axis is not None:
        y = jax.lax.psum(y, expert_axis)  # each pair's output from its expert's device; zeros from the others
    weighted = y.astype(jnp.float32) * weights[..., None]
    out = weighted[:, 0]
    for j in range(1, k):  # in expert order, as transformers' index_add over experts
        out = out + weighted[:, j]
    return out.astype(x.dtype)


GRANULES_PER_TILE = 2
"""An expert's pairs are padded to whole granules of `tile / 2` rows (32 for the CPU's 64), at least a tile's worth."""
TILE_SIZES = (8, 4, 3, 2)
"""The matmuls an expert's granules run in, in granules (256, 128, 96 and 64 rows for 32-row granules): as many of 8
and of 4 as fit, the rest in one of 2 or 3, or (one granule left over) 2 + 3 borrowed from a 4 or 4 + 2 + 3 from an 8
(expert_tiles). Fewer rows a matmul cost more a row (on the CPU a matmul of 64 rows takes about twice the time per
row of one of 256); each size is one more loop to compile (16-row granules and six sizes ran no faster at E = 32 and
took 25% longer to compile)."""


def expert_tiles(granules: jax.Array) -> dict[int, jax.Array]:
    """How many matmuls of each of TILE_SIZES cover `granules` (i32[E]: each 0 or at least GRANULES_PER_TILE)
    exactly."""
    q8, rest = granules // 8, granules % 8
    q4, t = rest // 4, rest % 4
    one = t == 1  # too few for a matmul: 4 + 1 = 2 + 3; with no 4, 8 + 1 = 4 + 2 + 3
    from8 = one & (q4 == 0)
    return {8: q8 - from8, 4: q4 - (one & ~from8) + from8, 3: ((t == 3) | one).astype(granules.dtype),
            2: ((t == 2) | one).astype(granules.dtype)}


class _Layout(eqx.Module):
    """Pairs laid out by expert in the rows of a padded array: expert e's pairs in order from row `first_row[e]`."""
    rows: jax.Array  # [N, H]: each pair's row of x where a pair sits, zeros elsewhere
    pair_row: jax.Array  # i32[P]: each pair's row in `rows`; N for a pair of no expert


def _layout(x: jax.Array, k: int, pair_expert: jax.Array, counts: jax.Array, first_row: jax.Array,
            num_rows: int) -> _Layout:
    """The pairs (pair p: row p // k of x [R, H], expert pair_expert[p]; E, past the last: none) laid out in
    `num_rows` rows, expert e's `counts[e]` pairs from row first_row[e] on."""
    R, E, P = x.shape[0], counts.shape[0], pair_expert.shape[0]
    order = jnp.argsort(pair_expert, stable=True)  # pairs grouped by expert, rows in order within one
    first_pair = jnp.cumsum(counts) - counts  # [E]: the expert's first pair in `order`
    sorted_expert = pair_expert[order]
    e = jnp.minimum(sorted_expert, E - 1)
    # Each sorted pair's row; a pair of no expert gets none (out of range: dropped).
    row = jnp.where(sorted_expert < E, first_row[e] + jnp.arange(P) - first_pair[e], num_rows)
    source = jnp.full((num_rows,), R, jnp.int32).at[row].set((order // k).astype(jnp.int32), mode="drop")
    return _Layout(x.at[source].get(mode="fill", fill_value=0),  # padding rows (R) read zeros
                   jnp.zeros((P,), row.dtype).at[order].set(row))


def _pair_outputs(out: jax.Array, layout: _Layout) -> jax.Array:
    """The rows of `out` (one per row of layout.rows) back in pair order [P, H]; no expert's pairs: zeros."""
    return out.at[layout.pair_row].get(mode="fill", fill_value=0)


def _tiled_grouped_mlp(x: jax.Array, k: int, pair_expert: jax.Array,
                       weights: tuple[jax.Array, jax.Array, jax.Array], tile: int) -> jax.Array:
    """The experts' MLP of the pairs [P = R * k, H] (pair p: row p // k of `x` [R, H], expert `pair_expert[p]`; E,
    past the last: no expert, output zeros), in pair order.

    Expert e's pairs fill max(2, ceil(counts[e] / g)) granules of g = tile / 2 rows, zero-padded, run as matmuls of
    TILE_SIZES granules of its own weights, an expert at a time (its weights sliced once), experts with no pair
    skipped. Every matmul has at least `tile` rows, so a row's bits do not depend on which matmul holds it or where
    (XLA's CPU matmuls give a row the same bits in any call of 64 rows or more), and an expert wastes less than a
    granule (or a tile, with fewer pairs than one)."""
    P, E = pair_expert.shape[0], weights[0].shape[0]
    g = tile // GRANULES_PER_TILE
    if g * GRANULES_PER_TILE != tile:
        raise ValueError(f"internal error: expert tiles of {tile} rows are not whole granules of {g}")
    counts = jnp.bincount(pair_expert, length=E)  # i32[E] (no expert is not counted)
    granules = jnp.where(counts > 0, jnp.maximum(GRANULES_PER_TILE, -(-counts // g)), 0)
    # Enough for any routing (an expert wastes less than a tile), and for the largest matmul's slice.
    num_granules = max(-(-P // g) + E * GRANULES_PER_TILE, max(TILE_SIZES))
    first_granule = jnp.cumsum(granules) - granules  # [E]
    layout = _layout(x, k, pair_expert, counts, first_granule * g, num_granules * g)
    tiles = expert_tiles(granules)
    active = jnp.flatnonzero(granules > 0, size=E, fill_value=0)
    w_gate, w_up, w_down = weights

    def one_expert(i: jax.Array, out: jax.Array) -> jax.Array:
        e = active[i]
        w = (w_gate[e], w_up[e], w_down[e])
        start = first_granule[e]
        for size in TILE_SIZES:
            def one_tile(_, carry, size=size):
                out, start = carry
                y = _expert(jax.lax.dynamic_slice_in_dim(layout.rows, start * g, size * g), *w)
                return jax.lax.dynamic_update_slice_in_dim(out, y.astype(out.dtype), start * g, 0), start + size

            out, start = jax.lax.fori_loop(0, tiles[size][e], one_tile, (out, start))
        return out

    return _pair_outputs(jax.lax.fori_loop(0, jnp.sum(granules > 0), one_expert, jnp.zeros_like(layout.rows)), layout)


GENERATED_TILE_ROWS = 8
"""The rows of every expert matmul of generated tokens' pairs on the CPU. One count, so one rounding for a generated
token wherever it is computed. For one MoE layer of a 64-row decode step (top-2, 256 wide), 4 rows ran no faster at
E = 32 and slower at E = 8; 16 rows 1.5x slower at E = 32."""


def _small_tiled_mlp(x: jax.Array, k: int, pair_expert: jax.Array,
                     weights: tuple[jax.Array, jax.Array, jax.Array]) -> jax.Array:
    """`_tiled_grouped_mlp`'s result for pairs of generated tokens: expert e's pairs in ceil(counts[e] / n) matmuls
    of exactly n = GENERATED_TILE_ROWS rows (zero-padded) of its weights, an expert at a time (its weights sliced
    once, not once a matmul: XLA copies the slice; a 64-row decode step's layer at E = 8 ran 16% faster so), experts
    with no pair skipped."""
    P, E, n = pair_expert.shape[0], weights[0].shape[0], GENERATED_TILE_ROWS
    counts = jnp.bincount(pair_expert, length=E)
    tiles = -(-counts // n)  # [E]
    ends = jnp.cumsum(tiles)
    num_tiles = -(-P // n) + E  # enough for any routing: an expert wastes less than a tile
    layout = _layout(x, k, pair_expert, counts, (ends - tiles) * n, num_tiles * n)
    active = jnp.flatnonzero(tiles > 0, size=E, fill_value=0)
    w_gate, w_up, w_down = weights

    def one_expert(i: jax.Array, out: jax.Array) -> jax.Array:
        e = active[i]
        w = (w_gate[e], w_up[e], w_down[e])

        def one_tile(t: jax.Array, out: jax.Array) -> jax.Array:
            y = _expert(jax.lax.dynamic_slice_in_dim(layout.rows, t * n, n), *w)
            return jax.lax.dynamic_update_slice_in_dim(out, y.astype(out.dtype), t * n, 0)

        return jax.lax.fori_loop(ends[e] - tiles[e], ends[e], one_tile, out)

    return _pair_outputs(jax.lax.fori_loop(0, jnp.sum(tiles > 0), one_expert, jnp.zeros_like(layout.rows)), layout)
