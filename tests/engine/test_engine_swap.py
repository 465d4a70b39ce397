"""Swap preemption on a real model (tiny presets, XLA CPU): a pool too small for the workload gives the samples
of recompute and of an ample pool, greedy and seeded, with n > 1, with a sliding-window model; stats show the
pages moved and, under swap, no token recomputed."""

from __future__ import annotations

import json

import numpy as np
import pytest

from engine.config import EngineConfig, SamplingConfig
from engine.engine import Engine
from engine.models.presets import write_model
from engine.scheduling.sequence import Request

WINDOW = 12  # the sliding-window model's window: shorter than every sequence here


# The default run swaps on Llama (native CPU kernel), Qwen3 on the reference attention (its QK-norm layer, and the
# reference's paths) and Qwen3-MoE (rows sharing experts); Qwen3 on the CPU kernel and Mixtral add no path of their
# own here (test_engine.py runs their batch invariance by default), so they run under -m slow with the window model.
@pytest.fixture(scope="module", params=["tiny-llama", pytest.param("tiny-qwen3", marks=pytest.mark.slow),
                                        "tiny-qwen3-reference", pytest.param("tiny-mixtral", marks=pytest.mark.slow),
                                        "tiny-qwen3-moe", pytest.param("tiny-qwen2-moe", marks=pytest.mark.slow),
                                        pytest.param("tiny-mistral-window", marks=pytest.mark.slow)])
def model(request, tmp_path_factory):
    """(a preset's checkpoint, the attention_impl its engines use: `-reference` the reference attention, else the
    native CPU kernel that `auto` picks for a float32 pool)."""
    preset = request.param.removesuffix("-window").removesuffix("-reference")
    path = write_model(preset, tmp_path_factory.mktemp(request.param))
    if request.param.endswith("-window"):
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**config, "sliding_window": WINDOW}))
    return path, "reference" if request.param.endswith("-reference") else "auto"


def _requests(temperature: float, n: int) -> list[Request]:
    rng = np.random.default_rng(11)
    sampling = SamplingConfig(max_new_tokens=48, temperature=temperature, top_p=0.9, seed=6, n=n, logprobs=True)
    return [Request(f"r{i}", tuple(rng.integers(6, 512, int(rng.integers(4, 30))).tolist()), sampling,
                    generation_index=g) for i in range(6) for g in range(n)]


def _run(model, requests, **engine) -> tuple[dict, Engine]:
    path, impl = model
    eng = Engine(path, EngineConfig(page_size=8, max_seqs=6, max_seqs_in_prefill=3, max_prefill_size=32,
                                    max_seq_len=96, debug_invariants=True, attention_impl=impl, **engine))
    out = eng.generate(requests)
    assert all(c.error is None for c in out)
    return {(c.prompt_id, c.generation_index): (c.token_ids, c.logprobs) for c in out}, eng


SMALL = dict(max_pages=16)  # six sequences of up to 78 tokens want up to 60 pages


def _three_ways(model, temperature: float, n: int):
    requests = _requests(temperature, n)
    ample, ample_engine = _run(model, requests, max_pages=200)
    recompute, recompute_engine = _run(model, requests, preemption="recompute", host_kv_pages=64, **SMALL)
    swap, swap_engine = _run(model, requests, preemption="swap", host_kv_pages=64, **SMALL)
    assert ample_engine.scheduler.num_preemptions == 0
    assert recompute_engine.scheduler.num_preemptions > 0 and swap_engine.scheduler.num_preemptions > 0
    return ample, recompute, swap, recompute_engine, swap_engine


def _tokens(samples: dict) -> dict:
    return {k: tokens for k, (tokens, _) in samples.items()}


@pytest.mark.parametrize("temperature,n", [(0.0, 1), pytest.param(0.8, 2, marks=pytest.mark.slow)])
def test_swap_recompute_and_an_ample_pool_give_bit_identical_samples(model, temperature, n):
    """Swapped KV comes back bit for bit (tests/engine/kv/test_kv_swap.py), recomputed KV is the KV the decode steps
    wrote, and the model's row tiles keep each row's arithmetic independent of the batch (docs/engine.md): the
    three give the same samples, logprobs included, though they batch differently; the stats show pages moved
    under swap and nothing recomputed."""
    ample, recompute, swap, recompute_engine, swap_engine = _three_ways(model, temperature, n)
    assert _tokens(swap) == _tokens(recompute) == _tokens(ample)  # the tokens first: a clearer failure
    assert swap == recompute == ample
    moved, dropped = swap_engine.stats, recompute_engine.stats
    assert moved.kv_pages_out > 0 and moved.kv_pages_in > 0 and moved.recompute_avoided_tokens > 0
    assert moved.recompute_tokens == 0 and swap_engine.scheduler.swapper.num_fallbacks == 0  # nothing recomputed
    assert dropped.recompute_tokens > 0 and recompute_engine.scheduler.swapper.num_swaps == 0
    swapper = swap_engine.scheduler.swapper  # after the call the host pool holds the prefix cache's host tier only
    assert moved.host_kv_pages_peak <= 64 and swapper.host.num_used == len(swapper.cache)
    page_bytes = swap_engine.runner.kv.host_pool[0].nbytes * swap_engine.runner.kv.num_layers
    assert moved.device_to_host_bytes["swap"] == moved.kv_pages_out * page_bytes  # no padding page crosses
    assert moved.host_to_device_bytes["swap"] >= moved.kv_pages_in * page_bytes


def test_a_full_host_pool_falls_back_to_recompute_with_the_same_tokens(model):
    requests = _requests(0.8, 1)
    ample, _ = _run(model, requests, max_pages=200)
    got, engine = _run(model, requests, preemption="swap", host_kv_pages=6, **SMALL)
    swapper = engine.scheduler.swapper
    assert swapper.num_fallbacks > 0 and engine.stats.recompute_tokens > 0
    assert engine.stats.host_kv_pages_peak <= 6
    assert _tokens(got) == _tokens(ample)


def test_a_step_that_pages_in_reads_nothing_back_before_its_tokens(model):
    """Overlap: a step's page-outs are read back only after its own tokens (the copy runs behind the step),
    and its page-ins, even of pages paged out in the same step, read nothing back (they once waited for every
    page-out first). Events in order: page-ins (with page-outs in flight or not) and the ledger's reads."""
    requests = _requests(0.0, 1)
    eng = Engine(model[0], EngineConfig(page_size=8, max_seqs=6, max_seqs_in_prefill=3, max_prefill_size=32,
                                        max_seq_len=96, preemption="swap", host_kv_pages=64, attention_impl=model[1],
                                        **SMALL))
    events, kv, ledger = [], eng.runner.kv, eng.runner.transfers
    page_in, read = kv.page_in, ledger.read
    kv.page_in = lambda h, d: (events.append(("page_in", bool(kv._pending_out) and bool(h))), page_in(h, d))[1]
    ledger.read = lambda **a: (events.append(("read", tuple(a))), read(**a))[1]
    samples = {(c.prompt_id, c.generation_index): (c.token_ids, c.logprobs) for c in eng.generate(requests)}
    assert samples == _run(model, requests, max_pages=200)[0]
    assert ("page_in", True) in events  # a step paged in while its page-outs were in flight
    for i, (kind, what) in enumerate(events):
        if kind == "page_in":
            after = [w for k, w in events[i + 1:] if k == "read"]
            assert after and "swap" not in after[0], "a page-in's step read a page back before its tokens"
