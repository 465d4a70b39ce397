"""A token's logits are the same bits whatever step computes it: alone in a step of one 64-row tile, beside a
long prompt in a step of one 256-row tile, or after one in a step of 512 rows. The engine's guarantee that a
sample does not depend on its batch rests on this, per family; greedy logprobs of the tiny test models are often
exactly 0, so a sample-level test alone could miss a difference in the last bits."""

from __future__ import annotations

import numpy as np
import pytest

from engine.config import EngineConfig
from engine.device.runner import ModelRunner, SeqChunk
from engine.device.runner_config import RunnerConfig
from engine.models.weights import load_transformer
from tests.engine.models.hf_reference import FAMILIES, make_hf_model

PAGE = 16
# Every family at its test shape, and the QK-norm families at a released model's head shape too (8 KV heads of
# 128, as Qwen3-8B; Gemma 3 27B's heads are 128 wide): a QK-norm sums over a short axis, which XLA's CPU backend
# rounds by the call's row count (engine/device/row_tiles.py).
BIG_HEADS = dict(heads=8, kv_heads=8, head_dim=128)
CASES = {**{family: (family, {}) for family in FAMILIES},
         "qwen3-heads-of-128": ("qwen3", BIG_HEADS), "gemma3_text-heads-of-128": ("gemma3_text", BIG_HEADS)}


def _runner(path, mesh=None) -> ModelRunner:
    config = EngineConfig(page_size=PAGE, max_pages=96, max_seqs=4, max_prefill_size=1024, max_seq_len=1024)
    return ModelRunner(load_transformer(path, mesh=mesh), RunnerConfig.of(config), max_seq_len=1024, mesh=mesh)


def _pages(first: int, num_tokens: int) -> list[int]:
    """Consecutive pages from `first` for `num_tokens` tokens (the tests give each sequence its own range)."""
    return list(range(first, first + -(-num_tokens // PAGE)))


@pytest.fixture(scope="module", params=list(CASES))
def runner(request, tmp_path_factory):
    family, shape = CASES[request.param]
    path = tmp_path_factory.mktemp(family)
    make_hf_model(family, path, vocab=512, **shape)
    return _runner(path)


def test_a_tokens_logits_do_not_depend_on_the_step_around_it(runner):
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, 500, 15).tolist()
    long = rng.integers(3, 500, 480).tolist()
    alone = runner.logits([SeqChunk(prompt, 0, _pages(0, 15))])[0]
    beside = runner.logits([SeqChunk(prompt, 0, _pages(0, 15)), SeqChunk(long[:200], 0, _pages(10, 200))])[0]
    after = runner.logits([SeqChunk(long, 0, _pages(10, 480)), SeqChunk(prompt, 0, _pages(0, 15))])[1]
    assert (np.asarray(beside) == np.asarray(alone)).all(), "a 256-row step"
    assert (np.asarray(after) == np.asarray(alone)).all(), "a 512-row step"


def test_a_tokens_logits_are_the_same_computed_in_a_prompt_or_decoded(runner):
    """Recompute preemption, the prefix cache and swap rest on this: a position's KV and logits are the same bits
    whether its token came in a prompt chunk or was decoded one step at a time."""
    rng = np.random.default_rng(1)
    prompt = rng.integers(3, 500, 40).tolist()
    whole = np.asarray(runner.logits([SeqChunk(prompt, 0, _pages(0, 40))])[0])
    runner.logits([SeqChunk(prompt[:23], 0, _pages(10, 40))])
    for i in range(23, 40):  # then one token a step, the way a sample's own tokens are computed
        decoded = np.asarray(runner.logits([SeqChunk(prompt[i:i + 1], i, _pages(10, 40))])[0])
    assert (decoded == whole).all()


def test_scanned_layers_over_four_devices_give_a_position_the_same_bits_in_a_prompt_or_decoded(tmp_path, monkeypatch):
    """The layers as one scanned program (as on a TPU) at `model: 4`: XLA recomputed RoPE inside the fusion that
    writes K to the pool and rounded it differently in a prefill and a decode step (a position's K, and every
    logit after it, differed), until RoPE ran in the native library beside the CPU kernel."""
    import dataclasses

    import engine.device.runner as runner_module
    from engine.distributed import slice_mesh
    from engine.models.presets import PRESETS, write_model

    monkeypatch.setattr(runner_module, "unstack_layers", lambda model: model)  # keep the stacked layers: a scan
    kv4 = dataclasses.replace(PRESETS["tiny-llama"], num_attention_heads=8, num_key_value_heads=4, head_dim=8)
    runner = _runner(write_model(kv4, tmp_path / "kv4"), mesh=slice_mesh(4))
    assert not isinstance(runner.model.layers, tuple)
    prompt = np.random.default_rng(0).integers(3, 500, 16).tolist()
    whole = np.asarray(runner.logits([SeqChunk(prompt, 0, _pages(0, 16))])[0])
    runner.logits([SeqChunk(prompt[:15], 0, _pages(10, 16))])
    last = np.asarray(runner.logits([SeqChunk(prompt[15:], 15, _pages(10, 16))])[0])
    for i, token in enumerate(prompt):  # every position decoded
        decoded = np.asarray(runner.logits([SeqChunk([token], i, _pages(20, i + 1))])[0])
    assert (last == whole).all() and (decoded == whole).all()
