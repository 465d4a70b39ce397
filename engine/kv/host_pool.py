"""The host KV pool of one process: its own shards of the device pool's pages, in the device pool's layout.

On a multi-host slice the device pool (engine/kv/kv_cache.py) is one global array sharded over KV heads; each
process addresses only some of its shards, and copies only those to and from its host memory. The host pool
holds one numpy array per distinct shard this process addresses (a shard replicated on several of its devices
is kept once): host page h of layer (slot) i at row i * num_pages + h, the shard's slice of every other dimension
after it. One process with every shard (no mesh, or a mesh of one process) holds the whole pool.

Which host page holds which page is the scheduler's, decided alike on every host (engine/kv/swap.py); the bytes
of a page's shards stay on the host that addresses them. Nothing here crosses between hosts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # JAX at run time in to_device alone: PoolTooLarge is the head's too (engine/__init__.py)
    import jax

Key = tuple[tuple[int, int], ...]  # a shard's [start, stop) in every dimension after the first (pages x layers)


class PoolTooLarge(ValueError):
    """A KV pool (engine.max_pages on the device, engine.host_kv_pages on the host) larger than the memory it
    goes in: a configuration error that every start would meet again."""


def check_fits(key: str, num_pages: int, page_bytes: int) -> None:
    """Raise PoolTooLarge, naming `key`, when `num_pages` pages of `page_bytes` (this process's shards of a page)
    would not fit in the host memory available now. The host pool maps its pages lazily, so without this check a
    pool too large for the host would start and fail only when it fills, hours into a run."""
    from engine.sizing.machine_sizing import mem_available_bytes

    try:
        available = mem_available_bytes()
    except (OSError, RuntimeError):  # no /proc/meminfo (not Linux): nothing to check against
        return
    if num_pages * page_bytes > available:
        gib = 2**30
        raise PoolTooLarge(
            f"{key}={num_pages:,} takes {num_pages * page_bytes / gib:,.1f} GiB of host memory "
            f"({page_bytes:,} bytes a page on this host), more than the {available / gib:.1f} GiB it has "
            f"available; set {key} to at most {available // page_bytes:,}")


def shard_bytes(keys, num_layers: int, dtype) -> int:
    """Bytes of one page (every layer) in the shards `keys`."""
    return num_layers * np.dtype(dtype).itemsize * sum(int(np.prod([b - a for a, b in key])) for key in keys)


def shard_key(index: tuple[slice, ...], shape: tuple[int, ...]) -> Key:
    """A shard's place in every dimension but the first, which a page pool never splits."""
    return tuple(s.indices(n)[:2] for s, n in zip(index[1:], shape[1:]))


class HostShards:
    def __init__(self, sharding: jax.sharding.Sharding, pool_shape: tuple[int, ...], num_layers: int,
                 num_pages: int, dtype, units_per_page: int = 1) -> None:
        """`num_pages` pages of `num_layers` layers each: units of the KV layer groups (engine/kv/kv_groups.py),
        `units_per_page` of them to a page of every layer (engine.host_kv_pages counts those)."""
        self.num_layers, self.num_pages = num_layers, num_pages
        self._dims = tuple(pool_shape[1:])  # the whole pool's, every host's shards together
        self.shards: dict[Key, np.ndarray] = {}
        keys = []
        for index in sharding.addressable_devices_indices_map(pool_shape).values():
            assert index[0].indices(pool_shape[0])[:2] == (0, pool_shape[0]), "a KV pool sharded over its pages"
            if (key := shard_key(index, pool_shape)) not in keys:
                keys.append(key)
        if num_pages:
            check_fits("engine.host_kv_pages", num_pages // units_per_page,
                       units_per_page * shard_bytes(keys, num_layers, dtype))
        for key in keys:  # np.zeros maps untouched pages lazily: an unused host pool costs no memory
            self.shards[key] = np.zeros((num_layers * num_pages, *(b - a for a, b in key)), dtype)

    def rows(self, host_pages: np.ndarray) -> np.ndarray:
        """Rows holding `host_pages` in every layer, layer-major (the order of a gathered block of pages)."""
        return (np.arange(self.num_layers)[:, None] * self.num_pages + host_pages[None, :]).reshape(-1)

    def local_shards(self, block: jax.Array) -> dict[Key, jax.Array]:
        """This process's distinct shards of a block of pages (as the device pool is sharded), by key."""
        out: dict[Key, jax.Array] = {}
        for shard in block.addressable_shards:
            out.setdefault(shard_key(shard.index, block.shape), shard.data)
        return out

    def write(self, key: Key, host_pages: np.ndarray, data: np.ndarray) -> None:
        """Store one shard of a block [layers * n, ...] (or a longer, padded one: the first n pages of each
        layer) in `host_pages`."""
        n = len(host_pages)
        data = data.reshape(self.num_layers, -1, *data.shape[1:])[:, :n]
        self.shards[key][self.rows(host_pages)] = data.reshape(-1, *data.shape[2:])

    def read(self, host_pages: np.ndarray) -> dict[Key, np.ndarray]:
        """Each shard's rows of `host_pages`, layer-major (copies: the pool may be written again at once)."""
        rows = self.rows(host_pages)
        return {key: shard[rows] for key, shard in self.shards.items()}

    def to_device(self, parts: dict[Key, np.ndarray], sharding: jax.sharding.Sharding) -> jax.Array:
        """One global block from this process's parts (`read`), placed by `sharding` without waiting: each
        addressable device gets its shard's part (every host sends its own)."""
        first = next(iter(parts.values()))
        shape = (first.shape[0], *self._dims)
        import jax

        return jax.make_array_from_callback(shape, sharding, lambda index: parts[shard_key(index, shape)])
