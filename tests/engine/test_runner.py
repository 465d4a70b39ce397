"""ModelRunner.build_inputs: the host arrays a step program reads (decode-only steps take a path of their own)."""

from __future__ import annotations

import numpy as np
import pytest

from engine.config import EngineConfig
from engine.engine import Engine
from engine.presets import write_model
from engine.runner import SeqChunk


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    model = write_model("tiny-llama", tmp_path_factory.mktemp("tiny-llama"))
    return Engine(model, EngineConfig(page_size=8, max_pages=64, max_seq_len=128, max_seqs=8)).runner


def test_decode_only_inputs(runner):
    from engine.runner import MIN_ROWS

    chunks = [SeqChunk([5], 0, [3]), SeqChunk([7], 9, [1, 4]), SeqChunk([9], 16, [2, 0, 6])]
    got = runner.build_inputs(chunks, [0, 0, 1, 2])
    pad = MIN_ROWS - 3  # 3 sequences in the MIN_ROWS-row bucket
    np.testing.assert_array_equal(got.token_ids, [5, 7, 9] + [0] * pad)
    np.testing.assert_array_equal(got.positions, [0, 9, 16] + [0] * pad)
    np.testing.assert_array_equal(got.slot_mapping, [3 * 8, 4 * 8 + 1, 6 * 8] + [64 * 8] * pad)  # padding: out of range
    np.testing.assert_array_equal(got.cu_q_lens, [0, 1, 2, 3] + [3] * pad)
    np.testing.assert_array_equal(got.kv_lens, [1, 10, 17] + [0] * pad)
    expected_pages = np.zeros((MIN_ROWS, runner.pages_per_seq), np.int32)
    expected_pages[0, :1], expected_pages[1, :2], expected_pages[2, :3] = [3], [1, 4], [2, 0, 6]
    np.testing.assert_array_equal(got.page_indices, expected_pages)
    np.testing.assert_array_equal(got.num_seqs, [3])
    np.testing.assert_array_equal(got.logits_indices, [0, 0, 1, 2] + [0] * (MIN_ROWS - 4))
    np.testing.assert_array_equal(runner.build_inputs(chunks).logits_indices, [0, 1, 2] + [0] * pad)
    # The same sequences with a prompt chunk among them take the general path: same per-token arrays.
    mixed = runner.build_inputs(chunks + [SeqChunk([1, 2], 0, [5])])
    np.testing.assert_array_equal(mixed.slot_mapping[:3], got.slot_mapping[:3])
    np.testing.assert_array_equal(mixed.page_indices[:3], got.page_indices[:3])
    np.testing.assert_array_equal(mixed.kv_lens[:3], got.kv_lens[:3])


def test_a_decode_token_beyond_its_pages_is_refused(runner):
    with pytest.raises(ValueError, match="chunk 1: 1 token at position 8 with 1 pages"):
        runner.build_inputs([SeqChunk([5], 0, [3]), SeqChunk([1], 8, [3])])
    with pytest.raises(ValueError, match="chunk 0: 1 token at position 128"):
        runner.build_inputs([SeqChunk([5], 128, list(range(17)))])


@pytest.mark.parametrize("preset", ["tiny-llama", "llama-40m"])
def test_the_backend_gives_a_row_the_same_matmul_result_on_one_row_and_on_min_rows_or_more(preset):
    """The runner pads every matmul to 1 row or to at least MIN_ROWS (engine/runner.py): this checks the
    assumption on this backend, for every weight shape of the preset's model, with the other rows random."""
    import jax
    import jax.numpy as jnp

    from engine.presets import PRESETS
    from engine.runner import MIN_ROWS

    p = PRESETS[preset]
    q_dim, kv_dim = p.num_attention_heads * p.head_dim, p.num_key_value_heads * p.head_dim
    shapes = {(p.hidden_size, q_dim), (p.hidden_size, kv_dim), (q_dim, p.hidden_size),
              (p.hidden_size, p.intermediate_size), (p.intermediate_size, p.hidden_size), (p.hidden_size, p.vocab_size)}
    rng = np.random.default_rng(0)
    matmul = jax.jit(lambda x, w: x @ w)
    for k, n in sorted(shapes):
        w = jnp.asarray(rng.standard_normal((k, n)), jnp.float32)
        x = jnp.asarray(rng.standard_normal((4 * MIN_ROWS, k)), jnp.float32)
        alone = np.asarray(matmul(x[:1], w))[0]
        for rows in (MIN_ROWS, 2 * MIN_ROWS, 4 * MIN_ROWS):
            assert np.array_equal(np.asarray(matmul(x[:rows], w))[0], alone), f"[{rows}, {k}] @ [{k}, {n}]"
