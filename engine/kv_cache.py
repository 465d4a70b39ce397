"""The paged KV cache: one device pool for every layer, and its sharding. Device only: which page belongs to
which sequence is the scheduler's (its PageAllocator)."""

from __future__ import annotations

import functools

import haliax as hax
import numpy as np
import jax
import jax.numpy as jnp
from haliax import NamedArray
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding

from engine.model import kv_pool_axes
from engine.model_config import ModelConfig
from engine.transfers import TransferLedger
from engine.weights import partition_spec


class KVCache:
    """Pool: [layers * num_pages, page_size, 2 * kv_heads, head_dim], sharded over KV heads on a `model` mesh axis.

    Page p of the scheduler's allocator is page p of every layer (layer i's copy sits at i * num_pages + p).
    """

    def __init__(self, cfg: ModelConfig, num_pages: int, page_size: int, transfers: TransferLedger,
                 dtype=jnp.float32, mesh: Mesh | None = None) -> None:
        """`transfers`: the runner's ledger, which counts the page indices a page copy sends."""
        self.num_pages = num_pages
        self._transfers = transfers
        self.page_size = page_size
        self._axes = kv_pool_axes(cfg, num_pages, page_size)
        self._dtype = dtype
        # An explicit sharding even without a mesh: the pool every step donates back comes out committed to
        # this device, and a fresh pool must look the same to jit, or the first step compiles twice.
        self._sharding = (SingleDeviceSharding(jax.local_devices()[0]) if mesh is None
                          else NamedSharding(mesh, partition_spec(self._axes, mesh)))
        self.pool: NamedArray = self._zeros()

    def _zeros(self) -> NamedArray:
        shape = tuple(a.size for a in self._axes)
        make = jax.jit(lambda: jnp.zeros(shape, self._dtype), out_shardings=self._sharding)
        return hax.named(make(), self._axes)

    def copy_pages(self, src: list[int], dst: list[int]) -> None:
        """Copy pages src[i] -> dst[i] in every layer (a forked sample's partial last page)."""
        if not src:
            return
        n = 1 << (len(src) - 1).bit_length()  # pad to a power of two: few compiled shapes
        s = np.zeros(n, np.int32)
        d = np.full(n, np.iinfo(np.int32).max, np.int32)  # padding: out of range, dropped
        s[:len(src)], d[:len(dst)] = src, dst
        layers = self.pool.array.shape[0] // self.num_pages
        with self._transfers.sending(page_copies=(s, d)):
            self.pool = hax.named(_copy_pages(self.pool.array, s, d, self.num_pages, layers), self.pool.axes)

    def zero(self) -> None:
        """A fresh zeroed pool (a physical reset, or after a failed step donated the pool away)."""
        self.pool = self._zeros()


@functools.partial(jax.jit, donate_argnums=(0,), static_argnums=(3, 4))
def _copy_pages(pool: jax.Array, src: jax.Array, dst: jax.Array, num_pages: int, num_layers: int) -> jax.Array:
    offsets = jnp.arange(num_layers, dtype=jnp.int32)[:, None] * num_pages  # [layers, 1]
    src_all = (offsets + src[None, :]).reshape(-1)
    dst_all = jnp.where(dst[None, :] < num_pages, offsets + dst[None, :], jnp.iinfo(jnp.int32).max).reshape(-1)
    return pool.at[dst_all].set(pool[src_all], mode="drop")
