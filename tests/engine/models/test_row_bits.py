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
from tests.engine.models.hf_reference import FAMILIES, MOE_FAMILIES, make_hf_model

PAGE = 16
# Every family at its test shape, and the QK-norm families at a released model's head shape too (8 KV heads of
# 128, as Qwen3-8B; Gemma 3 27B's heads are 128 wide): a QK-norm sums over a short axis, which XLA's CPU backend
# rounds by the call's row count (engine/device/row_tiles.py).
BIG_HEADS = dict(heads=8, kv_heads=8, head_dim=128)
# A mixture of experts 256 wide as well: XLA's CPU matmuls of 8 and of 64 rows round a row alike at the test shape
# (64 wide, experts 128 wide) and differently from K = 256 on, so only there does a generated token's expert matmul
# (engine/models/moe.py) show whether it has one row count wherever the token is computed.
CASES = {**{family: (family, {}) for family in FAMILIES},
         "qwen3-heads-of-128": ("qwen3", BIG_HEADS), "gemma3_text-heads-of-128": ("gemma3_text", BIG_HEADS),
         "mixtral-256-wide": ("mixtral", dict(hidden=256, intermediate=256))}


def _runner(path, mesh=None, attention_impl: str = "auto") -> ModelRunner:
    config = EngineConfig(page_size=PAGE, max_pages=96, max_seqs=4, max_prefill_size=1024, max_seq_len=1024,
                          attention_impl=attention_impl)
    return ModelRunner(load_transformer(path, mesh=mesh), RunnerConfig.of(config), max_seq_len=1024, mesh=mesh)


def _pages(first: int, num_tokens: int) -> list[int]:
    """Consecutive pages from `first` for `num_tokens` tokens (the tests give each sequence its own range)."""
    return list(range(first, first + -(-num_tokens // PAGE)))


def _case_runner(case: str, tmp_path_factory, attention_impl: str = "auto") -> ModelRunner:
    family, shape = CASES[case]
    path = tmp_path_factory.mktemp(family)
    make_hf_model(family, path, vocab=512, **shape)
    return _runner(path, attention_impl=attention_impl)


@pytest.fixture(scope="module", params=list(CASES))
def runner(request, tmp_path_factory):
    return _case_runner(request.param, tmp_path_factory)


def test_a_tokens_logits_do_not_depend_on_the_step_around_it(runner):
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, 500, 15).tolist()
    long = rng.integers(3, 500, 480).tolist()
    alone = runner.logits([SeqChunk(prompt, 0, _pages(0, 15))])[0]
    beside = runner.logits([SeqChunk(prompt, 0, _pages(0, 15)), SeqChunk(long[:200], 0, _pages(10, 200))])[0]
    after = runner.logits([SeqChunk(long, 0, _pages(10, 480)), SeqChunk(prompt, 0, _pages(0, 15))])[1]
    assert (np.asarray(beside) == np.asarray(alone)).all(), "a 256-row step"
    assert (np.asarray(after) == np.asarray(alone)).all(), "a 512-row step"


def _decoded_equals_whole(runner: ModelRunner, num_prompt_tokens: int | None) -> None:
    """A 40-token sequence's last logits computed in one chunk, and with positions 23 on decoded one a step."""
    rng = np.random.default_rng(1)
    prompt = rng.integers(3, 500, 40).tolist()
    whole = np.asarray(runner.logits([SeqChunk(prompt, 0, _pages(0, 40), num_prompt_tokens)])[0])
    runner.logits([SeqChunk(prompt[:23], 0, _pages(10, 40), num_prompt_tokens)])
    for i in range(23, 40):  # then one token a step, the way a sample's own tokens are computed
        decoded = np.asarray(runner.logits([SeqChunk(prompt[i:i + 1], i, _pages(10, 40), num_prompt_tokens)])[0])
    assert (decoded == whole).all()


def test_a_tokens_logits_are_the_same_computed_in_a_prompt_or_decoded(runner):
    """Recompute preemption, the prefix cache and swap rest on this: a position's KV and logits are the same bits
    whether its token came in a prompt chunk or was decoded one step at a time."""
    _decoded_equals_whole(runner, None)


# XLA's expert matmuls (`reference`) on the case whose rounding shows a row count (256 wide) and on the family with a
# shared expert in the default run; on the other families too under -m slow. The native kernels on every case.
REFERENCE_DEFAULT = {"mixtral-256-wide", "qwen2_moe"}
MOE_RUNNERS = [(case, impl) for case, (family, _) in CASES.items() if family in MOE_FAMILIES
               for impl in ("cpu_kernel", "reference")]


@pytest.fixture(scope="module", ids=lambda p: "-".join(p), params=[
    p if p[1] == "cpu_kernel" or p[0] in REFERENCE_DEFAULT else pytest.param(p, marks=pytest.mark.slow)
    for p in MOE_RUNNERS])
def moe_runner(request, tmp_path_factory):
    """`runner` for the mixtures of experts only: they compute a generated token's experts in matmuls of another
    size than a prompt token's (engine/models/moe.py); a dense model computes both kinds alike. With the native CPU
    kernels (the library's grouped matmul) and without them (XLA's matmuls of 8 rows): the routing a family adds
    does not change how many rows a matmul has, so `reference` need not run on every family by default."""
    return _case_runner(*request.param[:1], tmp_path_factory, attention_impl=request.param[1])


def test_a_generated_tokens_logits_are_the_same_recomputed_or_decoded(moe_runner):
    """The same for generated tokens (positions 23 on), which a preempted sequence recomputes in a prompt chunk."""
    _decoded_equals_whole(moe_runner, 23)


def test_a_generated_tokens_logits_do_not_depend_on_the_step_around_it(moe_runner):
    """A generated token decoded alone, beside 63 other sequences' generated tokens, in a step with a prompt chunk
    or with a long recomputed one: the same bits (a mixture of experts groups a step's generated tokens by expert
    into matmuls of one row count, apart from its prompt tokens)."""
    runner = moe_runner
    rng = np.random.default_rng(2)
    seq = rng.integers(3, 500, 20).tolist()
    others = rng.integers(3, 500, 63).tolist()
    runner.logits([SeqChunk(seq[:19], 0, _pages(0, 20), 10)])  # positions 10 .. 18 generated, recomputed

    def last(*beside: SeqChunk) -> np.ndarray:
        return np.asarray(runner.logits([SeqChunk(seq[19:], 19, _pages(0, 20), 10), *beside])[0])
    alone = last()
    assert (last(*(SeqChunk([t], 0, _pages(2 + i, 1), 0) for i, t in enumerate(others))) == alone).all(), \
        "beside 63 decode rows"
    assert (last(SeqChunk(others[:40], 0, _pages(70, 40))) == alone).all(), "beside a prompt chunk"
    recomputed = rng.integers(3, 500, 300).tolist()  # a preempted sequence's 299 generated tokens: ~75 an expert
    assert (last(SeqChunk(recomputed, 0, _pages(70, 300), 1)) == alone).all(), "beside 299 recomputed tokens"


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
