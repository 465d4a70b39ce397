"""Row-wise device work in row tiles of a kernel class, so that a row's bits never depend on the rows beside it.

XLA's CPU backend picks a matmul kernel by the number of rows (calls of 2-32 rows round a row differently
from calls of 64 or more) and vectorizes a row reduction (softmax) across rows once there are enough of
them. A token computed in a 4,096-token prompt step, in a 40-token chunk after cached prefix pages, or in an
8-row decode step would then differ in the last bits, and so would its logprobs. Run on tiles that always
fall in one kernel class (at least 64 rows for matmuls, exactly 8 rows for sampling), every row goes through
the same arithmetic in every step. Tiles past a step's real rows are skipped (`num_rows`).

A reduction over a short axis is the exception: XLA's CPU backend sums a row of 16 to 128 elements (a head's
QK-norm) in an order that depends on how many rows the call has, at every tile size (a [64, 8, 128] call rounds
other rows than a [512, 8, 128] one). Such sums go through `ordered_sum`, whose order is fixed.
"""

from __future__ import annotations

from typing import Callable

import haliax as hax
import jax
import jax.numpy as jnp
from haliax import NamedArray


MAX_TILE = 512
"""Most rows per tile: large enough that a tile's matmuls run near the machine's peak, small enough that the
tiles past a step's real tokens (its padding up to the shape bucket) are skipped in useful pieces."""


def row_tile(rows: int, min_rows: int) -> int:
    """The tile for `rows` rows when every matmul needs at least `min_rows` (0: no tiles): `rows` itself within
    [min_rows, MAX_TILE] (one tile, padded up to `min_rows`), else MAX_TILE."""
    return min(max(rows, min_rows), max(MAX_TILE, min_rows)) if min_rows else 0


def ordered_sum(x: NamedArray, axis: str) -> NamedArray:
    """The sum over `axis` in one fixed order, by halves (elementwise adds of the two halves, zero-padded to a
    power of two, until one element is left): its bits do not depend on the other axes' sizes, unlike `hax.sum`'s
    over a short axis on the CPU (module doc)."""
    rest = tuple(a for a in x.axes if a.name != axis)
    a = x.rearrange((*rest, x.resolve_axis(axis))).array
    n = a.shape[-1]
    width = 1 << max(0, (n - 1).bit_length())
    a = jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, width - n)])
    while a.shape[-1] > 1:
        half = a.shape[-1] // 2
        a = a[..., :half] + a[..., half:]
    return hax.named(a[..., 0], rest)


def by_row_tiles(f: Callable, tile: int, *xs, num_rows: jax.Array | None = None):
    """`f(*xs)` for a row-wise `f` over pytrees of arrays whose leading axis is the row (row i of every output
    depends only on row i of every input), computed on tiles of exactly `tile` rows one after another:
    rows are padded with zeros to whole tiles and the padding is dropped from the outputs. `tile` 0: at once.

    `num_rows` (a traced int, optional): only the rows below it matter. When there are several tiles, those
    wholly past it are not computed (a step's padding up to its shape bucket costs nothing) and their output
    rows are zeros."""
    if not tile:
        return f(*xs)
    n = jax.tree.leaves(xs)[0].shape[0]
    k = -(-n // tile)

    def split(a: jax.Array) -> jax.Array:
        return jnp.pad(a, [(0, k * tile - n)] + [(0, 0)] * (a.ndim - 1)).reshape(k, tile, *a.shape[1:])

    tiled = jax.tree.map(split, xs)
    if num_rows is None or k == 1:
        out = jax.lax.map(lambda tiles: f(*tiles), tiled)
    else:
        def one(i, out):
            y = f(*jax.tree.map(lambda a: a[i], tiled))
            return jax.tree.map(lambda o, t: o.at[i].set(t), out, y)

        shapes = jax.eval_shape(lambda tiles: f(*tiles), jax.tree.map(lambda a: a[0], tiled))
        out = jax.tree.map(lambda s: jnp.zeros((k, *s.shape), s.dtype), shapes)
        out = jax.lax.fori_loop(0, jnp.minimum((num_rows + tile - 1) // tile, k), one, out)
    return jax.tree.map(lambda y: y.reshape(k * tile, *y.shape[2:])[:n], out)


def by_named_rows(f: Callable, tile: int, row_axis: str, *xs: NamedArray, num_rows: jax.Array | None = None):
    """`by_row_tiles` for named arrays: the rows are axis `row_axis` of each x (and of each output of `f`,
    a pytree of named arrays); `f` sees that axis with `tile` rows."""
    if not tile:
        return f(*xs)
    xs = tuple(x.rearrange((row_axis, ...)) for x in xs)
    Rows = xs[0].axes[0]
    Tile = Rows.resize(tile)
    structure: list = []  # the outputs' tree and axes (after the rows), found when `f` is traced

    def on_arrays(*arrays: jax.Array) -> list[jax.Array]:
        out = f(*(hax.named(a, (Tile,) + x.axes[1:]) for a, x in zip(arrays, xs)))
        leaves, tree = jax.tree.flatten(out, is_leaf=lambda y: isinstance(y, NamedArray))
        leaves = [y.rearrange((row_axis, ...)) for y in leaves]
        structure[:] = [tree, [y.axes[1:] for y in leaves]]
        return [y.array for y in leaves]

    arrays = by_row_tiles(on_arrays, tile, *(x.array for x in xs), num_rows=num_rows)
    tree, axes = structure
    return jax.tree.unflatten(tree, [hax.named(a, (Rows,) + rest) for a, rest in zip(arrays, axes)])
