"""The per-call performance summary: the loop's wall time split into device calls and host work."""

from __future__ import annotations

import time

from engine.stats import DeviceClock, EngineStats, StepTimer


def test_wall_time_splits_into_device_calls_and_host_work():
    stats, clock = EngineStats(), DeviceClock()
    with StepTimer(stats, clock):
        time.sleep(0.01)  # host work inside the step (input packing)
        with clock.timing():
            time.sleep(0.05)  # a device call
    time.sleep(0.03)  # host work between steps (stop checks, scheduling)
    with StepTimer(stats, clock):
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
    with StepTimer(stats, clock):
        pass
    assert stats.summary(max_seqs=4)["device_s"] < 0.01
    stats.clear()
    assert stats.summary(max_seqs=4) == {"steps": 0, "prefix_cache_query_tokens": 0, "prefix_cache_hit_tokens": 0,
                                         "prefix_cache_hit_rate": 0.0} and stats.first_start is None


def test_the_prefix_cache_counters_reach_the_summary_and_clear_with_it():
    stats = EngineStats()
    with StepTimer(stats, DeviceClock()):
        stats.prefix_cache_query_tokens += 400  # what the scheduler's cache records at admission
        stats.prefix_cache_hit_tokens += 300
    s = stats.summary(max_seqs=4)
    assert (s["prefix_cache_query_tokens"], s["prefix_cache_hit_tokens"], s["prefix_cache_hit_rate"]) == (400, 300, 0.75)
    stats.clear()
    assert stats.prefix_cache_query_tokens == stats.prefix_cache_hit_tokens == 0
