"""The per-call performance summary: the loop's wall time split into device calls and host work."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp

from engine import Engine, EngineConfig, Request, SamplingConfig, write_model
from engine.device import compile_cache
from engine.stats import DeviceClock, EngineStats, StepTimer, host_kv_counters, host_kv_summary
from engine.device.transfers import TransferLedger, transfer_summary


def test_wall_time_splits_into_device_calls_and_host_work():
    stats, clock = EngineStats(), DeviceClock()
    with StepTimer(stats, clock, TransferLedger()):
        time.sleep(0.01)  # host work inside the step (input packing)
        with clock.timing():
            time.sleep(0.05)  # a device call
    time.sleep(0.03)  # host work between steps (stop checks, scheduling)
    with StepTimer(stats, clock, TransferLedger()):
        with clock.timing():
            time.sleep(0.02)
    s = stats.summary(max_seqs=4)
    assert s["steps"] == 2
    assert s["device_s"] >= 0.07  # both device calls, and nothing else: the host's 0.04 s are apart
    assert s["host_s"] >= 0.04  # the host work between the steps, which no device call covers
    assert s["step_ms_max"] >= 60


def test_device_time_outside_a_step_is_not_counted():
    stats, clock = EngineStats(), DeviceClock()
    with clock.timing():
        time.sleep(0.02)  # before any step: not this call's
    with StepTimer(stats, clock, TransferLedger()):
        pass
    assert stats.summary(max_seqs=4)["device_s"] < 0.01
    stats.clear()
    assert stats.summary(max_seqs=4) == {"steps": 0, "prefix_cache_query_tokens": 0, "prefix_cache_hit_tokens": 0,
                                         "prefix_cache_hit_rate": 0.0, **host_kv_summary([]),
                                         **transfer_summary({}, {}, 0), **NO_PROGRAMS}
    assert stats.first_start is None


NO_PROGRAMS = dict.fromkeys(compile_cache.PROGRAM_FIGURES, 0)


def test_the_programs_a_call_compiled_or_loaded_reach_its_summary_and_clear_with_it():
    compile_cache.count_programs()
    stats = EngineStats()
    x = jnp.arange(1009, dtype=jnp.float32)  # a shape no other test uses: a new program (or one loaded from the cache)
    jax.jit(lambda x: x * 3 + 1)(x).block_until_ready()
    s = stats.summary(max_seqs=4)
    assert s["programs_compiled"] + s["programs_loaded"] >= 1 and s["trace_lower_s"] > 0
    assert s["compile_s"] >= 0 and s["program_load_s"] >= 0
    stats.clear()
    assert stats.programs() == NO_PROGRAMS


def test_the_prefix_cache_counters_reach_the_summary_and_clear_with_it():
    stats = EngineStats()
    with StepTimer(stats, DeviceClock(), TransferLedger()):
        stats.prefix_cache_query_tokens += 400  # what the scheduler's cache records at admission
        stats.prefix_cache_hit_tokens += 300
    s = stats.summary(max_seqs=4)
    assert (s["prefix_cache_query_tokens"], s["prefix_cache_hit_tokens"], s["prefix_cache_hit_rate"]) == (400, 300, 0.75)
    stats.clear()
    assert stats.prefix_cache_query_tokens == stats.prefix_cache_hit_tokens == 0


def test_each_steps_transfers_are_summed_by_category_per_generated_token_and_cleared():
    """The ledger's bytes of a step (its device call) reach the stats when the step ends, summed over the steps
    by category; bytes per generated token divide the total by the tokens drawn; `clear` empties them."""
    import numpy as np

    stats, ledger = EngineStats(), TransferLedger()
    ledger.read(tokens=np.zeros(8, np.int32))  # before any step: counted with the first one (its call is open)
    for _ in range(2):
        with StepTimer(stats, DeviceClock(), ledger) as timer:
            ledger.read(tokens=np.zeros(8, np.int32), logprobs=np.zeros(8, np.float32))
            with ledger.sending(step_inputs=(np.zeros(16, np.int32), np.zeros(4, np.int32)),
                                page_tables=np.zeros((4, 8), np.int32)):
                pass
            timer.decode_tokens = 4
    s = stats.summary(max_seqs=4)
    assert (s["device_to_host_bytes_tokens"], s["device_to_host_bytes_logprobs"], s["device_to_host_bytes"]) == \
        (96, 64, 160)
    assert s["device_to_host_bytes_swap"] == s["device_to_host_bytes_steps"] == 0
    assert (s["host_to_device_bytes_step_inputs"], s["host_to_device_bytes_page_tables"]) == (160, 256)
    assert s["device_to_host_bytes_per_token"] == 160 / 8 and s["host_to_device_bytes_per_token"] == 416 / 8
    stats.clear()
    assert stats.summary(max_seqs=4)["device_to_host_bytes"] == 0 == stats.summary(max_seqs=4)["host_to_device_bytes"]


def test_a_category_the_ledger_does_not_know_is_refused():
    import numpy as np
    import pytest

    with pytest.raises(ValueError, match="'kv' is not a transfer category; valid: tokens, logprobs"):
        TransferLedger().read(kv=np.zeros(2))


def test_the_preemption_counters_reach_the_summary_sum_over_buckets_and_clear():
    stats = EngineStats()
    with StepTimer(stats, DeviceClock(), TransferLedger()):
        stats.kv_pages_out += 5  # what Engine.step records from the scheduler's output
        stats.kv_pages_in += 3
        stats.kv_pages_in_ahead += 2
        stats.recompute_avoided_tokens += 40
        stats.recompute_tokens += 7
        stats.host_kv_pages_peak = 5
    s = stats.summary(max_seqs=4)
    assert host_kv_counters(s) == {"kv_pages_out": 5, "kv_pages_in": 3, "kv_pages_in_ahead": 2,
                                   "recompute_avoided_tokens": 40,
                                   "recompute_tokens": 7, "host_kv_pages_peak": 5}
    other = {**host_kv_counters(s), "host_kv_pages_peak": 2}
    assert host_kv_summary([host_kv_counters(s), other, {}]) == {  # a bucket from before the counters: none
        "kv_pages_out": 10, "kv_pages_in": 6, "kv_pages_in_ahead": 4, "recompute_avoided_tokens": 80,
        "recompute_tokens": 14,
        "host_kv_pages_peak": 5}
    stats.clear()
    assert host_kv_counters(stats.summary(max_seqs=4)) == host_kv_summary([])


def test_an_engines_build_counts_in_its_first_figures_and_a_call_in_its_own(tmp_path):
    """The KV pool and the layers' programs compile (or load) while the engine builds: `Engine.programs` and the
    first figures read (a slice's first timeline bucket) hold them; a call's figures hold the call's alone."""
    engine = Engine(write_model("tiny-llama", tmp_path / "m"), EngineConfig(max_pages=24, max_seq_len=64))
    built = engine.programs()
    assert built["programs_compiled"] + built["programs_loaded"] >= 1
    assert engine.stats.programs() == built
    engine.generate([Request("a", (5, 6, 7), SamplingConfig(max_new_tokens=3))])
    call, total = engine.stats.programs(), engine.programs()
    assert call["programs_compiled"] + call["programs_loaded"] >= 1  # the step programs
    for k in ("programs_compiled", "programs_loaded"):
        assert total[k] == built[k] + call[k]
