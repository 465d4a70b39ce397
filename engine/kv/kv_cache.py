"""The paged KV cache: one device pool for every layer, its sharding, and the host pool that swapped-out and
spilled pages go to (`engine.host_kv_pages`). Data only: which page belongs to which sequence, on the device or
the host, is the KV cache manager's (engine/kv/kv_cache_manager.py), which the scheduler asks for pages.

Host memory kinds: where the backend has a `pinned_host` memory (TPU and GPU; this JAX's CPU backend too), the
page copies travel through it: a page-out's block is `device_put` to pinned host memory (an asynchronous DMA
the runtime starts at once) and a page-in's block is staged there before its `device_put` to the device.
Elsewhere a page-out starts with `copy_to_host_async` and a page-in sends the numpy block. `host_memory_kind`
is the one place that chooses. The host pool itself is numpy either way (written when a page-out is read back,
after the step that follows it: see the runner), one array per shard of the device pool this process addresses
(engine/kv/host_pool.py): on a multi-host slice every host copies its own shards, and nothing crosses hosts."""

from __future__ import annotations

import functools

import haliax as hax
import numpy as np
import jax
import jax.numpy as jnp
from haliax import NamedArray
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding

from engine.kv.host_pool import HostShards, PoolTooLarge, check_fits, shard_bytes, shard_key
from engine.kv.kv_groups import KVGroups
from engine.models.model import kv_pool_axes
from engine.models.model_config import ModelConfig
from engine.device.transfers import TransferLedger
from engine.models.weights import partition_spec


class KVCache:
    """Pool: [k * num_pages, page_size, 2 * kv_heads, head_dim], sharded over KV heads on a `model` mesh axis: the
    `num_pages` units of the KV cache manager's allocator, each k = `groups.layers_per_unit` layers deep
    (engine/kv/kv_groups.py). Slot s of unit u sits at s * num_pages + u; with one group (k = layers, units =
    pages) unit p is page p of every layer. Every copy below moves whole units: all k slots.
    """

    def __init__(self, cfg: ModelConfig, num_pages: int, page_size: int, transfers: TransferLedger,
                 dtype=jnp.float32, mesh: Mesh | None = None, host_pages: int = 0,
                 memory_kind: str | None | bool = True, groups: KVGroups | None = None) -> None:
        """`num_pages`: units (`groups.units(max_pages)`). `transfers`: the runner's ledger, which counts the page
        indices a page copy sends and the pages a swap moves. `host_pages`: pages of every layer in the host pool
        (0: none), which holds as many units per group. `memory_kind`: the host memory kind page copies travel
        through, True to choose it (`host_memory_kind`), None for none (tests). `groups`: the model's KV layer
        groups (default: one for every layer)."""
        self.num_pages = num_pages
        self.groups = groups or KVGroups.single(cfg.num_layers)
        self._transfers = transfers
        self.page_size = page_size
        self._axes = kv_pool_axes(cfg, num_pages, page_size, self.groups.layers_per_unit)
        self._dtype = dtype
        # An explicit sharding even without a mesh: the pool every step donates back comes out committed to
        # this device, and a fresh pool must look the same to jit, or the first step compiles twice.
        self._sharding = (SingleDeviceSharding(jax.local_devices()[0]) if mesh is None
                          else NamedSharding(mesh, partition_spec(self._axes, mesh)))
        # A block of gathered pages is sharded as the pool is (every host then holds its own pages' shards).
        self._block_sharding = None if mesh is None else self._sharding
        self.pool: NamedArray = self._allocate()
        devices = list(mesh.devices.flat) if mesh is not None else jax.local_devices()[:1]
        self.memory_kind = host_memory_kind(devices) if memory_kind is True else memory_kind
        self._host_sharding = (None if self.memory_kind is None
                               else self._sharding.with_memory_kind(self.memory_kind))
        self.num_host_pages = self.groups.units(host_pages)  # host units
        # This process's shards of the host pool, in the device pool's layout: slot s of host unit h at
        # s * num_host_pages + h.
        self.host = HostShards(self._sharding, tuple(a.size for a in self._axes), self.num_layers,
                               self.num_host_pages, np.dtype(dtype), units_per_page=self.groups.num_groups)
        # Page-outs not yet read to the host: (device block, its host-bound copy, host pages).
        self._pending_out: list[tuple[jax.Array, jax.Array, np.ndarray]] = []
        # Page-ins issued a step ahead, their blocks on their way to the device: (block, device pages).
        self._pending_in: list[tuple[jax.Array, np.ndarray]] = []

    @property
    def has_page_ins_ahead(self) -> bool:
        return bool(self._pending_in)

    @property
    def host_pool(self) -> np.ndarray:
        """The whole host pool, where this process holds it in one shard (no mesh, or no `model` axis)."""
        (shard,) = self.host.shards.values()
        return shard

    def _allocate(self) -> NamedArray:
        """The zeroed pool. One the memory cannot hold is a PoolTooLarge naming engine.max_pages: on the CPU,
        checked against the host's available memory first (zeroing a pool too large for it would have the
        kernel kill the process); elsewhere, when the device refuses the allocation."""
        shape = tuple(a.size for a in self._axes)
        per_device = [shard_key(index, shape) for index in self._sharding.addressable_devices_indices_map(shape).values()]
        # engine.max_pages: pages of every layer, each `num_groups` units; every device holds its own shards
        g = self.groups.num_groups
        max_pages, page_bytes = self.num_pages // g, g * shard_bytes(per_device, self.num_layers, self._dtype)
        if all(d.platform == "cpu" for d in self._sharding.addressable_devices):
            check_fits("engine.max_pages", max_pages, page_bytes)
        try:
            return self._zeros()
        except jax.errors.JaxRuntimeError as err:
            if "RESOURCE_EXHAUSTED" not in str(err):
                raise
            raise PoolTooLarge(
                f"engine.max_pages={max_pages:,} takes {max_pages * page_bytes / 2**30:,.1f} GiB on this "
                f"host's devices, more than they can allocate ({str(err).splitlines()[0]}); set engine.max_pages or "
                "engine.kv_memory_gib lower") from err

    def _zeros(self) -> NamedArray:
        shape = tuple(a.size for a in self._axes)
        make = jax.jit(lambda: jnp.zeros(shape, self._dtype), out_shardings=self._sharding)
        return hax.named(make(), self._axes)

    def copy_pages(self, src: list[int], dst: list[int]) -> None:
        """Copy units src[i] -> dst[i], all their slots (a forked sample's partial last page)."""
        if not src:
            return
        n = 1 << (len(src) - 1).bit_length()  # pad to a power of two: few compiled shapes
        s = np.zeros(n, np.int32)
        d = np.full(n, np.iinfo(np.int32).max, np.int32)  # padding: out of range, dropped
        s[:len(src)], d[:len(dst)] = src, dst
        with self._transfers.sending(page_copies=(s, d)):
            self.pool = hax.named(_copy_pages(self.pool.array, s, d, self.num_pages, self.num_layers), self.pool.axes)

    @property
    def num_layers(self) -> int:
        """Layers in one unit (its slots): every copy moves this many rows per unit."""
        return self.groups.layers_per_unit

    def page_out(self, device_pages: list[int], host_pages: list[int]) -> None:
        """Copy device units to host units (all their slots), bit for bit. Asynchronous: the copy is dispatched
        now and lands in the host pool at `finish_page_outs` (the pages may be reused by the next step: the
        copy reads the pool as it is now)."""
        if not device_pages:
            return
        # In power-of-two pieces, largest first: few compiled shapes, and no padding bytes cross to the host.
        for lo, hi in _pieces(len(device_pages)):
            src = np.asarray(device_pages[lo:hi], np.int32)
            with self._transfers.sending(swap=src):
                block = _gather_pages(self.pool.array, src, self.num_pages, self.num_layers, self._block_sharding)
            if self._host_sharding is None:
                for shard in self.host.local_shards(block).values():
                    self._transfers.prefetch(shard)  # start the copy of this host's shards now
                on_host = block
            else:  # a DMA to pinned host memory, dispatched now, running behind the step
                on_host = jax.device_put(block, self._host_sharding)
            # The device block stays until the page-out lands, for a page-in of the same step.
            self._pending_out.append((block, on_host, np.asarray(host_pages[lo:hi], np.int64)))

    def finish_page_outs(self) -> None:
        """Write the dispatched page-outs into the host pool (reading this host's shards through the transfer
        ledger)."""
        for _, on_host, dst in self._pending_out:
            for key, shard in self.host.local_shards(on_host).items():
                self.host.write(key, dst, self._transfers.read(swap=shard)[0])
        self._pending_out = []

    def page_in(self, host_pages: list[int], device_pages: list[int]) -> None:
        """Copy host units back to device units (all their slots), bit for bit, without waiting for anything: a
        host page whose page-out is still in flight (dispatched this step) is copied from that page-out's device
        block, the others are sent from the host pool with an asynchronous `device_put`; the scatters are
        dispatched and the runtime orders them before the step that reads the pages."""
        self._page_in(host_pages, device_pages, ahead=False)

    def page_in_ahead(self, host_pages: list[int], device_pages: list[int]) -> None:
        """`page_in` for a later step: the blocks from the host pool start their `device_put` now and are
        written into the pool at `land_page_ins` (before the next step), so the copy runs behind this step's
        compute, which the scatter would otherwise wait for. The device pages must be unread until then."""
        self._page_in(host_pages, device_pages, ahead=True)

    def land_page_ins(self) -> None:
        """Write the blocks `page_in_ahead` sent into the pool (dispatched: the scatter waits on the copy only)."""
        for block, dst in self._pending_in:
            self._scatter(block, dst)
        self._pending_in = []

    def _page_in(self, host_pages: list[int], device_pages: list[int], ahead: bool) -> None:
        if not host_pages:
            return
        in_flight = {}  # host page -> (pending block, its row): a later page-out of a host page wins
        for b, (_, _, dst) in enumerate(self._pending_out):
            in_flight.update({int(h): (b, j) for j, h in enumerate(dst)})
        by_block: dict[int, tuple[list[int], list[int]]] = {}
        settled: tuple[list[int], list[int]] = ([], [])
        for h, d in zip(host_pages, device_pages):
            if h in in_flight:
                b, j = in_flight[h]
                by_block.setdefault(b, ([], []))[0].append(j)
                by_block[b][1].append(d)
            else:
                settled[0].append(h)
                settled[1].append(d)
        for b, (rows, dst) in by_block.items():
            block = self._pending_out[b][0]
            src, dst = _padded(rows, 0), _padded(dst, np.iinfo(np.int32).max)
            with self._transfers.sending(swap=(src, dst)):
                self.pool = hax.named(_scatter_from_block(self.pool.array, block, src, dst, self.num_pages,
                                                          self.num_layers), self.pool.axes)
        for lo, hi in _pieces(len(settled[0])):  # as page-outs: power-of-two pieces, no padding bytes
            parts = self.host.read(np.asarray(settled[0][lo:hi], np.int64))  # this host's shards, [layers * n, ...]
            dst = np.asarray(settled[1][lo:hi], np.int32)
            with self._transfers.sending(swap=tuple(parts.values())):
                # Asynchronous: the scatter waits on it, the host not. Staged in pinned host memory, then a DMA.
                block = self.host.to_device(parts, self._host_sharding or self._sharding)
                if self._host_sharding is not None:
                    block = jax.device_put(block, self._sharding)
            if ahead:
                self._pending_in.append((block, dst))
            else:
                self._scatter(block, dst)

    def _scatter(self, block: jax.Array, dst: np.ndarray) -> None:
        with self._transfers.sending(swap=dst):
            self.pool = hax.named(_scatter_pages(self.pool.array, block, dst, self.num_pages, self.num_layers),
                                  self.pool.axes)

    def discard_page_outs(self) -> None:
        """Forget dispatched page-outs (a reset: no sequence refers to their host pages any more)."""
        self._pending_out = []

    def _host_rows(self, host_pages: np.ndarray) -> np.ndarray:
        """Rows of the host pool holding `host_pages` in every slot, slot-major (the gather's order)."""
        return self.host.rows(host_pages)

    def zero(self) -> None:
        """A fresh zeroed pool (a physical reset, or after a failed step donated the pool away); dispatched
        page-outs are forgotten (nothing refers to their host pages after a reset)."""
        self.pool = self._zeros()
        self.discard_page_outs()
        self._pending_in = []


def host_memory_kind(devices) -> str | None:
    """The memory kind page copies to and from the host pool travel through: `pinned_host` when every device
    has it (TPU, GPU and this JAX's CPU backend), else None (numpy transfers)."""
    for device in devices:
        try:
            kinds = {m.kind for m in device.addressable_memories()}
        except (AttributeError, NotImplementedError, jax.errors.JaxRuntimeError):
            return None
        if "pinned_host" not in kinds:
            return None
    return "pinned_host"


def _pieces(n: int) -> list[tuple[int, int]]:
    """[lo, hi) ranges of n items in power-of-two sizes, largest first (n's binary digits)."""
    out, lo = [], 0
    for bit in range(n.bit_length() - 1, -1, -1):
        if n >> bit & 1:
            out.append((lo, lo + (1 << bit)))
            lo += 1 << bit
    return out


def _pad_size(n: int) -> int:
    return 1 << (n - 1).bit_length()  # a power of two: few compiled shapes


def _padded(pages: list[int], fill: int) -> np.ndarray:
    out = np.full(_pad_size(len(pages)), fill, np.int32)
    out[:len(pages)] = pages
    return out


@functools.partial(jax.jit, static_argnums=(2, 3, 4))
def _gather_pages(pool: jax.Array, src: jax.Array, num_pages: int, num_layers: int, sharding) -> jax.Array:
    """Units `src`, every slot of them, slot-major: [num_layers * len(src), page_size, 2 * kv_heads, head_dim]; sharded
    by `sharding` (the pool's on a mesh) unless None."""
    offsets = jnp.arange(num_layers, dtype=jnp.int32)[:, None] * num_pages
    block = pool[(offsets + src[None, :]).reshape(-1)]
    return block if sharding is None else jax.lax.with_sharding_constraint(block, sharding)


@functools.partial(jax.jit, donate_argnums=(0,), static_argnums=(4, 5))
def _scatter_from_block(pool: jax.Array, block: jax.Array, rows: jax.Array, dst: jax.Array, num_pages: int,
                        num_layers: int) -> jax.Array:
    """Write rows `rows` of a page-out's block (as `_gather_pages` returns it) to units `dst`, every slot."""
    per_layer = block.reshape(num_layers, -1, *block.shape[1:])[:, rows]
    return _scatter_pages.__wrapped__(pool, per_layer.reshape(-1, *block.shape[1:]), dst, num_pages, num_layers)


@functools.partial(jax.jit, donate_argnums=(0,), static_argnums=(3, 4))
def _scatter_pages(pool: jax.Array, block: jax.Array, dst: jax.Array, num_pages: int, num_layers: int) -> jax.Array:
    """Write `block` (as `_gather_pages` returns it) to units `dst`, every slot; out-of-range pages are dropped."""
    offsets = jnp.arange(num_layers, dtype=jnp.int32)[:, None] * num_pages
    dst_all = jnp.where(dst[None, :] < num_pages, offsets + dst[None, :], jnp.iinfo(jnp.int32).max).reshape(-1)
    return pool.at[dst_all].set(block.astype(pool.dtype), mode="drop")


@functools.partial(jax.jit, donate_argnums=(0,), static_argnums=(3, 4))
def _copy_pages(pool: jax.Array, src: jax.Array, dst: jax.Array, num_pages: int, num_layers: int) -> jax.Array:
    offsets = jnp.arange(num_layers, dtype=jnp.int32)[:, None] * num_pages  # [layers, 1]
    src_all = (offsets + src[None, :]).reshape(-1)
    dst_all = jnp.where(dst[None, :] < num_pages, offsets + dst[None, :], jnp.iinfo(jnp.int32).max).reshape(-1)
    return pool.at[dst_all].set(pool[src_all], mode="drop")
