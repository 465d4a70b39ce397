"""The prefix cache's host tier on a real model (tiny-llama, XLA CPU): prompts whose cached prefixes the device
reclaimed between calls page them back in from the host, and give the samples, tokens and logprobs, of the
tier turned off (they recompute) and of a device pool that never reclaims, greedy and seeded, with n > 1 and
chunked prefill."""

from __future__ import annotations

import numpy as np
import pytest

from engine.config import EngineConfig, SamplingConfig
from engine.engine import Engine
from engine.models.presets import write_model
from engine.scheduling.sequence import Request


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_model("tiny-llama", tmp_path_factory.mktemp("tiny-llama"))


def _calls(temperature: float, n: int) -> list[list[Request]]:
    """Three calls: prompts on prefix X, then on prefix Y (which reclaims X's cached pages), then on X again."""
    rng = np.random.default_rng(13)
    x, y = (tuple(rng.integers(6, 512, 27).tolist()) for _ in range(2))  # 3 full pages of 8, and 3 tokens
    sampling = SamplingConfig(max_new_tokens=12, temperature=temperature, top_p=0.9, seed=4, n=n, logprobs=True)

    def call(name: str, prefix: tuple[int, ...]) -> list[Request]:
        return [Request(f"{name}{i}", prefix + tuple(rng.integers(6, 512, int(rng.integers(1, 12))).tolist()),
                        sampling, generation_index=g) for i in range(3) for g in range(n)]

    return [call("a", x), call("b", y), call("c", x)]


def _run(path, calls, **engine) -> tuple[list[dict], Engine, list[dict]]:
    eng = Engine(path, EngineConfig(page_size=8, max_seqs=4, max_seqs_in_prefill=2, max_prefill_size=16,
                                    max_seq_len=64, debug_invariants=True, **engine))
    samples, stats = [], []
    for requests in calls:
        out = eng.generate(requests)
        assert all(c.error is None for c in out)
        samples.append({(c.prompt_id, c.generation_index): (c.token_ids, c.logprobs) for c in out})
        stats.append({**eng.stats.summary(eng.config.max_seqs), "prefill_tokens": sum(eng.stats.prefill_tokens)})
    return samples, eng, stats


@pytest.mark.parametrize("temperature,n", [(0.0, 1), pytest.param(0.8, 2, marks=pytest.mark.slow)])
def test_the_host_tier_gives_the_samples_of_recompute_and_of_an_ample_pool(model, temperature, n):
    calls = _calls(temperature, n)
    ample, ample_engine, _ = _run(model, calls, max_pages=200)
    off, _, off_stats = _run(model, calls, max_pages=10)  # it preempts too (recompute)
    on, on_engine, on_stats = _run(model, calls, max_pages=10, host_kv_pages=64)
    assert on == off == ample
    assert ample_engine.stats.kv_pages_out == 0
    last_on, last_off = on_stats[-1], off_stats[-1]  # the third call: x's prefix was reclaimed by the second
    assert last_on["kv_pages_in"] >= 3 and last_on["recompute_avoided_tokens"] == 8 * last_on["kv_pages_in"]
    assert last_on["prefix_cache_hit_tokens"] > last_off["prefix_cache_hit_tokens"]
    assert last_on["prefill_tokens"] < last_off["prefill_tokens"]
    assert on_stats[1]["kv_pages_out"] > 0  # the second call spilled x's pages
    page_bytes = on_engine.runner.kv.host_pool[0].nbytes * on_engine.runner.kv.num_layers
    assert last_on["host_to_device_bytes_swap"] >= last_on["kv_pages_in"] * page_bytes
    swapper = on_engine.scheduler.swapper
    assert swapper.host.num_used == len(swapper.cache) <= 64
