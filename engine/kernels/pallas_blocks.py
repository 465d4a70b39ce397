"""Block sizes and VMEM footprint of JAX's Pallas ragged paged attention kernel, for a named TPU generation.

The kernel picks its own block sizes from a tuned table keyed by the TPU generation, which it reads from
`jax.devices()[0]`; on a CPU machine lowering for TPU (`pagefleet check`) that is a CPU device and the
kernel raises. So the engine always passes the sizes in, computed here by the kernel's own rule (its
`get_tuned_block_sizes`, with the device kind as an argument): the TPU being traced for is the abstract
mesh's device when one is set (`jax.sharding.AbstractMesh(..., abstract_device=...)`), else the first
device. On a TPU this gives exactly the sizes the kernel would have chosen, and the pre-flight reports
the sizes a run will use.

All shapes are per shard: inside the engine's `shard_map` the kernel sees `num_heads / tp` query heads
and `2 * num_kv_heads / tp` combined K/V heads.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as rpa
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import tuned_block_sizes as tuned

# Mosaic lays a VMEM array out in tiles of (8 * packing) sublanes x 128 lanes over its last two dimensions.
_LANES = 128
_SUBLANES = 8


@dataclass(frozen=True)
class KernelBlocks:
    """One kernel call's blocking on one TPU generation."""

    device_kind: str
    """JAX's device kind of the TPU generation, e.g. "TPU v5" (v5p), "TPU v6 lite" (v6e)."""
    kv_pages_per_block: int
    """KV pages each grid step copies into VMEM (per buffer; the kernel double-buffers)."""
    queries_per_block: int
    """Query tokens per grid step."""
    q_heads_per_block: int
    combined_kv_heads_per_block: int
    vmem_bytes: int
    """Estimated VMEM of one grid step in bytes: the double-buffered KV block, the online-softmax scratch
    (l, m, acc) and the double-buffered query and output blocks, each padded to Mosaic's tiles."""


def device_kind() -> str:
    """The device kind being traced for: the abstract mesh's device when set, else the first device's."""
    device = jax.sharding.get_abstract_mesh().abstract_device
    return device.device_kind if device is not None else jax.devices()[0].device_kind


def tpu_generation(kind: str) -> int:
    """The kernel's reading of a device kind ("TPU v5 lite" -> 5); -1 for a device that is not a TPU."""
    if "TPU" not in kind:
        return -1
    if kind == "TPU7x":
        return 7
    kind = kind.removesuffix(" lite")
    return int(kind[-1]) if kind[:-1] == "TPU v" else -1


def kernel_blocks(q_shape: tuple[int, ...], q_dtype, kv_shape: tuple[int, ...], kv_dtype, pages_per_seq: int,
                  kind: str | None = None) -> KernelBlocks:
    """The kernel's block sizes and VMEM estimate for q [T, heads, head_dim], kv pages [pages, page_size,
    combined_kv_heads, head_dim] and a page table `pages_per_seq` wide, on `kind` (default: `device_kind()`)."""
    kind = device_kind() if kind is None else kind
    num_tokens, num_q_heads, head_dim = q_shape
    _, page_size, combined, _ = kv_shape
    q_heads_blk, combined_blk = rpa.get_min_heads_per_blk(num_q_heads, combined, q_dtype, kv_dtype)
    generation = tpu_generation(kind)
    if generation < 4:
        raise ValueError(f"the Pallas ragged paged attention kernel needs a TPU v4 or newer; the device is {kind!r}")
    # tuned.get_tuned_block_sizes, with the device kind given rather than read from jax.devices().
    key = tuned.simplify_key((q_dtype, kv_dtype, q_heads_blk, combined_blk // 2, head_dim, page_size, num_tokens,
                              pages_per_seq))
    bkv, bq = (32, 32) if generation == 4 else tuned.TUNED_BLOCK_SIZES.get(" ".join(kind.split()[:2]), {}).get(
        key, (128, 32))
    bkv, bq = min(pages_per_seq, bkv), min(num_tokens, bq)
    return KernelBlocks(kind, bkv, bq, q_heads_blk, combined_blk,
                        _vmem_bytes(bkv, bq, page_size, q_heads_blk, combined_blk, head_dim, q_dtype, kv_dtype))


def _tile_bytes(shape: tuple[int, ...], dtype) -> int:
    """Bytes of a VMEM array after Mosaic pads its last two dimensions to whole tiles."""
    itemsize = jnp.dtype(dtype).itemsize
    packing = max(1, 4 // itemsize)
    *outer, rows, cols = shape
    # A second-minor dimension of 1, 2 or 4 packed sublanes takes a small tile (the kernel only uses such
    # sizes or multiples of 8: its `get_min_heads_per_blk`); anything else pads to whole 8-sublane tiles.
    sublanes = -(-rows // packing)
    sublanes = 1 << (sublanes - 1).bit_length() if sublanes <= 4 else -(-sublanes // _SUBLANES) * _SUBLANES
    rows = sublanes * packing
    cols = -(-cols // _LANES) * _LANES
    count = rows * cols
    for d in outer:
        count *= d
    return count * itemsize


def _vmem_bytes(bkv: int, bq: int, page_size: int, q_heads_blk: int, combined_blk: int, head_dim: int,
                q_dtype, kv_dtype) -> int:
    """The kernel's scratch (its `scratch_shapes`) plus its pipelined query and output blocks."""
    kv_heads_blk = combined_blk // 2
    q_per_kv = q_heads_blk // kv_heads_blk
    kv_buffers = _tile_bytes((2, bkv, page_size, combined_blk, head_dim), kv_dtype)
    l_and_m = 2 * _tile_bytes((kv_heads_blk, bq * q_per_kv, _LANES), jnp.float32)
    acc = _tile_bytes((bq, q_heads_blk, head_dim), jnp.float32)
    q_and_out = 2 * 2 * _tile_bytes((bq, q_heads_blk, head_dim), q_dtype)  # in and out, double-buffered
    return kv_buffers + l_and_m + acc + q_and_out
