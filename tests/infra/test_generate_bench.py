"""`make bench-generate`'s steady in-process figure: its timed call computes every prompt token, as the cold call did.

The benchmark runs the same prompts through one engine twice (the first call compiles, the second is timed) and
counts every prompt token as computed in its model FLOP/s. Were the second call to find the first call's pages in
the prefix cache, it would skip most of its prefill and the figures would count work it did not do.
"""

import importlib.util
import os
from pathlib import Path

import pytest

from engine.models.presets import write_model

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "generate_bench.py"


@pytest.fixture(scope="module")
def generate_bench():
    spec = importlib.util.spec_from_file_location("generate_bench", _PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_timed_in_process_call_reads_no_prompt_token_from_the_prefix_cache(generate_bench, tmp_path, monkeypatch):
    # engine_in_process turns the compile cache off for its process: the test's own settings come back after it.
    for name in ("PAGEFLEET_COMPILE_CACHE", "JAX_COMPILATION_CACHE_DIR"):
        monkeypatch.setenv(name, os.environ.get(name, ""))
    model = write_model("tiny-llama", tmp_path / "tiny-llama")
    # Whole pages of 16 tokens (cacheable), no two prompts sharing one (each its own first token).
    prompts = [[k] + list(range(100, 99 + n)) for k, n in ((10, 40), (11, 23), (12, 57))]
    flags = ["--engine.max_seqs=4", "--engine.max_prefill_size=64", "--engine.page_size=16", "--engine.max_pages=32"]
    ip = generate_bench.engine_in_process(model, prompts, 4, 128, flags)
    cold, warm = ip["cold"]["summary"], ip["warm"]["summary"]
    assert warm["prefix_cache_query_tokens"] == cold["prefix_cache_query_tokens"] > 0
    assert warm["prefix_cache_hit_tokens"] == cold["prefix_cache_hit_tokens"] == 0
    fed = [sum(r["tokens"] for r in run["records"] if not r["decode"]) for run in (ip["cold"], ip["warm"])]
    assert fed[0] == fed[1] >= sum(map(len, prompts))
    assert ip["warm"]["tokens"] == ip["cold"]["tokens"]
