"""Row tiles: a row's bits do not depend on how many rows share the call or where the row sits."""

from __future__ import annotations

import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine.device.row_tiles import MAX_TILE, by_named_rows, by_row_tiles, row_tile

ROW_COUNTS = (1, 2, 5, 16, 33, 64, 200)


def _rows_at(x: np.ndarray, m: int, pos: int) -> np.ndarray:
    """The first m rows of x with row 0 moved to `pos`."""
    a = np.array(x[:m])
    a[[0, pos]] = a[[pos, 0]]
    return a


@pytest.mark.parametrize("k, n", [(512, 512), (512, 256), (512, 1536), (1536, 512), (512, 8192)])
def test_a_matmul_row_is_the_same_bits_in_any_step(k, n):
    """XLA's CPU matmul picks its kernel by row count, so untiled rows move in the last bits at 2-32 rows (and
    for some shapes at any count); in tiles of the engine's rule (`row_tile`: at least 64 rows, at most
    MAX_TILE, padding tiles skipped) a row is the same bits at any count and position. The shapes are the
    ~40M preset's projections, MLP and LM head."""
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((k, n), np.float32))
    x = rng.standard_normal((4096, k)).astype(np.float32)
    plain = jax.jit(lambda a: a @ w)
    alone, moved = None, []
    for m in ROW_COUNTS + (512, 1024, 4096):
        tiled = jax.jit(lambda a, real: by_row_tiles(lambda t: t @ w, row_tile(m, 64), a, num_rows=real))
        for pos in {0, m // 2, m - 1}:
            got = np.asarray(tiled(_rows_at(x, m, pos), jnp.int32(m)))[pos]
            alone = got if alone is None else alone
            assert (got == alone).all(), (m, pos)
            if not any(moved):  # one row that moved is enough; at 4096 rows the untiled product costs seconds
                moved.append(not (np.asarray(plain(_rows_at(x, m, pos)))[pos] == np.asarray(plain(x[:1]))[0]).all())
    assert any(moved), "the untiled product no longer depends on the row count here: the test shows nothing"


def test_a_tiled_softmax_row_is_the_same_bits_in_any_batch():
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((max(ROW_COUNTS), 32000)) * 3).astype(np.float32)
    tiled = jax.jit(lambda a: by_row_tiles(lambda t: jax.nn.log_softmax(t, axis=-1), 8, a))
    alone = np.asarray(tiled(x[:1]))[0]
    for m in ROW_COUNTS:
        for pos in {0, m // 2, m - 1}:
            assert (np.asarray(tiled(_rows_at(x, m, pos)))[pos] == alone).all(), (m, pos)


def test_pytrees_and_named_axes_come_back_in_their_shapes():
    Rows, Embed, Out = hax.Axis("token", 37), hax.Axis("embed", 8), hax.Axis("out", 3)
    x = hax.random.normal(jax.random.key(0), (Embed, Rows))  # the rows need not come first
    w = hax.random.normal(jax.random.key(1), (Embed, Out))
    a, b = by_named_rows(lambda x: (hax.dot(x, w, axis=Embed), x * 2), 16, "token", x)
    assert a.axes == (Rows, Out) and b.axes == (Rows, Embed)
    np.testing.assert_allclose(a.rearrange((Rows, Out)).array, hax.dot(x, w, axis=Embed).rearrange((Rows, Out)).array,
                               rtol=1e-5, atol=1e-5)
    assert (b.array == (x * 2).rearrange((Rows, Embed)).array).all()
    none, y = by_row_tiles(lambda p, y: (p, y + 1), 4, None, jnp.arange(10))
    assert none is None and (np.asarray(y) == np.arange(1, 11)).all()


def test_the_tile_rule():
    assert [row_tile(r, 64) for r in (1, 16, 64, 100, MAX_TILE, 4096)] == [64, 64, 64, 100, MAX_TILE, MAX_TILE]
    assert row_tile(4096, 0) == 0  # no rule: the whole step at once


def test_tiles_past_num_rows_are_not_computed_and_the_rows_before_are_the_same_bits():
    """A step padded to its bucket: with `num_rows`, the rows below it are those of the whole computation,
    bit for bit, and the tiles past it are skipped (their rows are zeros, not f's value)."""
    rng = np.random.default_rng(2)
    w = jnp.asarray(rng.standard_normal((64, 32), np.float32))
    x = rng.standard_normal((100, 64)).astype(np.float32)
    f = jax.jit(lambda a, n: by_row_tiles(lambda t: t @ w + 1.0, 16, a, num_rows=n))
    whole = np.asarray(jax.jit(lambda a: by_row_tiles(lambda t: t @ w + 1.0, 16, a))(x))
    for n in (0, 1, 16, 17, 100):
        got = np.asarray(f(x, jnp.int32(n)))
        computed = -(-n // 16) * 16  # whole tiles
        assert (got[:computed] == whole[:computed]).all()
        assert (got[computed:] == 0).all(), n


def test_a_heads_mean_square_is_the_same_bits_in_any_step():
    """QK-norm over a head of 128 (8 heads, as Qwen3-8B's keys): its variance summed with `hax.mean` and fused
    into the normalization, XLA's CPU backend rounds rows differently at 64, 128 and 256 rows than at 512;
    `mean_square` sums in a fixed order."""
    from engine.models.axes import HEAD_SIZE
    from engine.models.model import mean_square

    rng = np.random.default_rng(2)
    x = rng.standard_normal((512, 8, 128)).astype(np.float32)

    def rows(f, m):
        axes = (hax.Axis("token", m), hax.Axis("kv_heads", 8), hax.Axis(HEAD_SIZE, 128))
        return np.asarray(jax.jit(lambda a: f(hax.named(a, axes)).array)(x[:m]))

    fixed = lambda a: a * hax.rsqrt(mean_square(a, HEAD_SIZE) + 1e-6)  # noqa: E731
    plain = lambda a: a * hax.rsqrt(hax.mean(a * a, axis=HEAD_SIZE) + 1e-6)  # noqa: E731
    counts = (8, 16, 64, 128, 256)
    for m in counts:
        assert (rows(fixed, m) == rows(fixed, 512)[:m]).all(), m
    assert any((rows(plain, m) != rows(plain, 512)[:m]).any() for m in counts), \
        "hax.mean no longer depends on the row count here: the test shows nothing"
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(rows(fixed, 512), x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + 1e-6), rtol=1e-6)
