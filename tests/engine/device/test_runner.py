"""ModelRunner.build_inputs: the host arrays a step program reads (decode-only steps take a path of their own)."""

from __future__ import annotations

import numpy as np
import pytest

from engine.models.axes import LAYERS
from engine.config import EngineConfig
from engine.engine import Engine
from engine.models.presets import write_model
from engine.device.runner import SeqChunk


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    model = write_model("tiny-llama", tmp_path_factory.mktemp("tiny-llama"))
    return Engine(model, EngineConfig(page_size=8, max_pages=64, max_seq_len=128, max_seqs=8)).runner


def test_decode_only_inputs(runner):
    chunks = [SeqChunk([5], 0, [3]), SeqChunk([7], 9, [1, 4]), SeqChunk([9], 16, [2, 0, 6])]
    got = runner.build_inputs(chunks, [0, 0, 1, 2])
    np.testing.assert_array_equal(got.token_ids, [5, 7, 9, 0])  # 3 sequences in the 4-row bucket
    np.testing.assert_array_equal(got.positions, [0, 9, 16, 0])
    np.testing.assert_array_equal(got.slot_mapping, [[3 * 8, 4 * 8 + 1, 6 * 8, 64 * 8]])  # padding: out of range
    np.testing.assert_array_equal(got.cu_q_lens, [0, 1, 2, 3, 3])
    np.testing.assert_array_equal(got.kv_lens, [1, 10, 17, 0])
    expected_pages = np.zeros((1, 4, runner.pages_per_seq), np.int32)  # one KV layer group
    expected_pages[0, 0, :1], expected_pages[0, 1, :2], expected_pages[0, 2, :3] = [3], [1, 4], [2, 0, 6]
    np.testing.assert_array_equal(got.page_indices, expected_pages)
    np.testing.assert_array_equal(got.num_seqs, [3])
    np.testing.assert_array_equal(got.logits_indices, [0, 0, 1, 2])
    np.testing.assert_array_equal(runner.build_inputs(chunks).logits_indices, [0, 1, 2, 0])
    # The same sequences with a prompt chunk among them take the general path: same per-token arrays.
    mixed = runner.build_inputs(chunks + [SeqChunk([1, 2], 0, [5])])
    np.testing.assert_array_equal(mixed.slot_mapping[:, :3], got.slot_mapping[:, :3])
    np.testing.assert_array_equal(mixed.page_indices[:, :3], got.page_indices[:, :3])
    np.testing.assert_array_equal(mixed.kv_lens[:3], got.kv_lens[:3])


def test_a_decode_token_beyond_its_pages_is_refused(runner):
    with pytest.raises(ValueError, match="chunk 1: 1 token at position 8 with 1 pages"):
        runner.build_inputs([SeqChunk([5], 0, [3]), SeqChunk([1], 8, [3])])
    with pytest.raises(ValueError, match="chunk 0: 1 token at position 128"):
        runner.build_inputs([SeqChunk([5], 128, list(range(17)))])


def test_a_cpu_runner_runs_the_layers_unrolled_so_no_step_copies_the_weights(runner):
    """A scan over stacked layers slices each layer's weights out of the stack (a copy of every weight per
    forward pass on a CPU); the CPU runner holds one DecoderLayer per layer and its step program has no scan."""
    import jax

    from engine.models.model import unstack_layers
    from engine.device.runner import _logits

    assert isinstance(runner.model.layers, tuple) and len(runner.model.layers) == runner.model.config.num_layers
    assert unstack_layers(runner.model) is runner.model
    inputs = jax.tree.map(np.asarray, runner.build_inputs([SeqChunk([5], 3, [1]), SeqChunk([6, 7], 0, [2])]))
    settings = runner._settings

    def program(model) -> str:
        return _logits.lower(model, runner.kv.pool, inputs, settings).compile().as_text()  # op names kept

    stacked = _stacked(runner.model)
    assert "scan(layers)" in program(stacked)  # the stacked form does slice the weights in a loop
    assert "scan(layers)" not in program(runner.model)


def _stacked(model):
    """`model` with its per-layer weights stacked back on a leading `layers` axis (the loaded form)."""
    import equinox as eqx
    import haliax as hax
    import jax
    import jax.numpy as jnp

    def stack(*xs):
        return hax.named(jnp.stack([x.array for x in xs]), (hax.Axis(LAYERS, len(xs)), *xs[0].axes))

    layers = jax.tree.map(stack, *model.layers, is_leaf=lambda x: isinstance(x, hax.NamedArray))
    return eqx.tree_at(lambda m: m.layers, model, layers)
