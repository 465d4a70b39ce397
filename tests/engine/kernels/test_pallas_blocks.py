"""The Pallas kernel's block sizes for a named TPU, and its VMEM estimate."""

import jax.numpy as jnp
import pytest
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import tuned_block_sizes as tuned

from engine.kernels.pallas_blocks import kernel_blocks, tpu_generation


@pytest.mark.parametrize("kind", ["TPU v5", "TPU v5 lite", "TPU v6 lite", "TPU v4"])
@pytest.mark.parametrize("tokens, q_heads, combined, page_size, pages_per_seq, dtype", [
    (16, 4, 2, 16, 192, jnp.bfloat16),  # Llama-3.1-8B at tensor parallel 8, a small step
    (2048, 4, 2, 16, 192, jnp.bfloat16),
    (256, 32, 16, 16, 256, jnp.bfloat16),  # Llama-3.1-8B unsharded
    (64, 4, 4, 32, 8, jnp.float32),
    (4, 8, 2, 128, 64, jnp.bfloat16),
])
def test_block_sizes_are_the_kernels_own_choice(monkeypatch, kind, tokens, q_heads, combined, page_size,
                                                 pages_per_seq, dtype):
    """What the kernel's `get_tuned_block_sizes` picks when the first device is `kind` (as on that TPU)."""
    kv_shape = (1000, page_size, combined, 128)
    ours = kernel_blocks((tokens, q_heads, 128), dtype, kv_shape, dtype, pages_per_seq, kind)
    monkeypatch.setattr(tuned, "get_tpu_version", lambda: tpu_generation(kind))
    monkeypatch.setattr(tuned, "get_device_name", lambda num_devices=None: " ".join(kind.split()[:2]))
    theirs = tuned.get_tuned_block_sizes(dtype, dtype, ours.q_heads_per_block, ours.combined_kv_heads_per_block // 2,
                                         128, page_size, tokens, pages_per_seq)
    assert (ours.kv_pages_per_block, ours.queries_per_block) == theirs


def test_tuned_table_entries_are_used():
    """A key of the v6e table: the tuned sizes, not the (128, 32) default."""
    table = tuned.TUNED_BLOCK_SIZES["TPU v6"]
    key, want = next((k, v) for k, v in table.items() if v != (128, 32) and k[0] == "bfloat16")
    _, _, q_heads, kv_heads, head_dim, page_size, tokens, max_len = key
    blocks = kernel_blocks((tokens, q_heads, head_dim), jnp.bfloat16, (100, page_size, 2 * kv_heads, head_dim),
                           jnp.bfloat16, max_len // page_size, "TPU v6 lite")
    assert (blocks.kv_pages_per_block, blocks.queries_per_block) == (min(max_len // page_size, want[0]),
                                                                     min(tokens, want[1]))


def test_vmem_estimate_by_hand():
    """Llama-3.1-8B at tensor parallel 8 on a v5p (bf16, 4 query heads and 1 KV head per shard, T=2048):
    128 pages x 32 queries per block."""
    b = kernel_blocks((2048, 4, 128), jnp.bfloat16, (10_000, 16, 2, 128), jnp.bfloat16, 192, "TPU v5")
    assert (b.kv_pages_per_block, b.queries_per_block, b.q_heads_per_block, b.combined_kv_heads_per_block) == (
        128, 32, 4, 2)
    kv = 2 * 128 * 16 * 2 * 128 * 2  # two buffers of 128 pages x 16 tokens x (K, V) x 128 dims, bf16 (one packed row)
    l_and_m = 2 * 1 * 128 * 128 * 4  # [kv heads 1, 32 queries x 4 heads, 128 lanes] f32, twice
    acc = 32 * 4 * 128 * 4  # [32, 4 heads, 128] f32: 4 sublanes is a small tile
    q_and_out = 4 * 32 * 4 * 128 * 2  # [32, 4 heads (2 packed rows -> a 2-row tile), 128] bf16, in and out, doubled
    assert b.vmem_bytes == kv + l_and_m + acc + q_and_out


def test_not_a_tpu_is_refused():
    assert tpu_generation("cpu") == -1 and tpu_generation("TPU v5 lite") == 5 and tpu_generation("TPU7x") == 7
    with pytest.raises(ValueError, match="TPU v4 or newer"):
        kernel_blocks((16, 4, 128), jnp.float32, (10, 16, 2, 128), jnp.float32, 4, "cpu")
