"""A temperature below GREEDY_BELOW (1e-5) samples greedily, its limit: a much smaller divisor scales logits past
float32's range, where every large logit reads +inf and the draw took the first of them, not the most likely (at
1.2e-38 every token drawn was token 1)."""

from __future__ import annotations

import numpy as np
import pytest

from engine.config import GREEDY_BELOW, SamplingConfig
from engine.engine import Engine
from engine.scheduling.sequence import Request
from engine.sizing import preflight
from tests.engine.sampling.test_penalties import VOCAB, engine, hf_model, prompts  # noqa: F401 (the fixture)


@pytest.mark.parametrize("decode_steps", [1, 4])
def test_tiny_temperatures_give_the_greedy_samples(hf_model, decode_steps):
    path, _ = hf_model
    eng: Engine = engine(path, decode_steps)
    ps = prompts()

    def run(**settings):
        sampling = SamplingConfig(max_new_tokens=16, logprobs=True, **settings)
        return eng.generate([Request(f"p{i}", tuple(p), sampling) for i, p in enumerate(ps)])

    greedy = run()
    for temperature in (1.2e-38, 1e-40, 1e-30, 1e-6, np.nextafter(np.float32(GREEDY_BELOW), np.float32(0))):
        for c, g in zip(run(temperature=float(temperature), seed=3), greedy):
            assert (c.token_ids, c.logprobs) == (g.token_ids, g.logprobs), temperature
    sampled = run(temperature=1.0, seed=3)
    assert any(c.token_ids != g.token_ids for c, g in zip(sampled, greedy)), "temperature 1 must draw otherwise"


def test_a_tiny_temperature_runs_the_greedy_program():
    """The host and `pagefleet check`'s lowering pick the program of a greedy job, top-k/p and min_p aside (as for
    temperature 0, and as vLLM resets them for a greedy request)."""
    tiny = SamplingConfig(temperature=1e-6, top_k=5, top_p=0.5, min_p=0.1)
    assert tiny.draw_temperature == 0.0 and SamplingConfig(temperature=GREEDY_BELOW).draw_temperature == GREEDY_BELOW
    assert preflight.sampling_mode(tiny, VOCAB) == "greedy"
    assert preflight.sampling_mode(SamplingConfig(temperature=GREEDY_BELOW, top_k=5), VOCAB) == "truncate"
