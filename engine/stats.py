"""Per-call performance: step wall times, the tokens each step carried, and host against device time."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from engine.device import compile_cache
from engine.scheduling.scheduler_output import StepCounts
from engine.device.transfers import transfer_summary

if TYPE_CHECKING:
    from engine.device.transfers import TransferLedger


class DeviceClock:
    """Seconds the host has spent in device calls: dispatching programs and waiting for their outputs.

    The runner times every call it makes into the device with it; the rest of the engine loop's time is
    host work (scheduling, input packing, stop checks, bookkeeping). On a CPU backend the "device" is the
    host's own cores, so the split says where the loop waits, not which silicon ran.
    """

    def __init__(self) -> None:
        self.total_s = 0.0
        self.serial = False
        """The benchmarking hook (benchmarks/host_bench.py): True makes each call wait for its outputs inside its
        timing, so `total_s` is the device's serial time; the engine leaves it False (calls overlap the host)."""

    @contextmanager
    def timing(self) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.total_s += time.perf_counter() - start


@dataclass
class EngineStats:
    step_s: list[float] = field(default_factory=list)
    device_s: list[float] = field(default_factory=list)  # of each step's wall time, in device calls
    prefill_tokens: list[int] = field(default_factory=list)  # prompt (and recomputed) tokens per step
    decode_tokens: list[int] = field(default_factory=list)  # tokens drawn per step (all of a multi-step call's)
    active_seqs: list[int] = field(default_factory=list)
    model_steps: list[int] = field(default_factory=list)  # forward passes per step: > 1 for a multi-step decode call
    prefix_cache_query_tokens: int = 0  # prompt tokens of admitted sequences looked up in the prefix cache
    prefix_cache_hit_tokens: int = 0  # of those, tokens whose KV came from cached pages (not computed)
    kv_pages_out: int = 0  # KV pages copied to the host pool (swap preemption, prefix pages spilled to the host tier)
    kv_pages_in: int = 0  # KV pages paged back in from it (swapped sequences, prefix hits in the host tier)
    kv_pages_in_ahead: int = 0  # of those, pages paged in a step ahead of the step reading them (staged)
    recompute_avoided_tokens: int = 0  # computed tokens whose KV came back from the host pool, not recomputed
    recompute_tokens: int = 0  # computed tokens preemptions dropped (to be recomputed)
    host_kv_pages_peak: int = 0  # most host pool pages in use after a step's scheduling
    device_to_host_bytes: dict[str, int] = field(default_factory=dict)  # by category (engine.transfers), over the steps
    host_to_device_bytes: dict[str, int] = field(default_factory=dict)  # by category, over the steps
    # The process's programs (compile_cache.programs) when the figures began: at clear(), or at the start of the
    # engine's build until the first clear (so a slice's first timeline bucket holds the build's programs).
    programs_before: dict[str, float] = field(default_factory=compile_cache.programs)
    first_start: float | None = None  # perf_counter at the first step's start
    last_end: float = 0.0  # perf_counter at the last step's end

    def add_scheduled(self, counts: StepCounts) -> None:
        """Count a scheduled step's prefix-cache and host-pool figures (`Scheduler.schedule`'s StepCounts)."""
        self.prefix_cache_query_tokens += counts.cache_query_tokens
        self.prefix_cache_hit_tokens += counts.cache_hit_tokens
        self.kv_pages_out += counts.kv_pages_out
        self.kv_pages_in += counts.kv_pages_in
        self.kv_pages_in_ahead += counts.kv_pages_in_ahead
        self.recompute_avoided_tokens += counts.swap_avoided_tokens
        self.recompute_tokens += counts.recompute_tokens
        self.host_kv_pages_peak = max(self.host_kv_pages_peak, counts.host_kv_pages_in_use)

    def clear(self) -> None:
        for values in (self.step_s, self.device_s, self.prefill_tokens, self.decode_tokens, self.active_seqs,
                       self.model_steps):
            values.clear()
        self.first_start, self.last_end = None, 0.0
        self.prefix_cache_query_tokens = self.prefix_cache_hit_tokens = 0
        self.kv_pages_out = self.kv_pages_in = self.recompute_avoided_tokens = self.recompute_tokens = 0
        self.kv_pages_in_ahead = 0
        self.host_kv_pages_peak = 0
        self.device_to_host_bytes.clear()
        self.host_to_device_bytes.clear()
        self.programs_before = compile_cache.programs()

    def prefix_cache(self) -> dict[str, float]:
        """Prompt tokens looked up in the prefix cache, those served from it, and their ratio (0 with no query)."""
        return prefix_cache_summary(self.prefix_cache_query_tokens, self.prefix_cache_hit_tokens)

    def host_kv(self) -> dict[str, int]:
        """Preemption's figures: pages swapped out and in, tokens whose recompute a swap avoided, tokens dropped
        for recompute, the host pool's peak use."""
        return {name: getattr(self, name) for name in HOST_KV_SUMS + (HOST_KV_PEAK,)}

    def transfers(self) -> dict[str, float]:
        """Bytes the steps moved each way, total and by category, and per generated token (engine.transfers)."""
        return transfer_summary(self.device_to_host_bytes, self.host_to_device_bytes, sum(self.decode_tokens))

    def programs(self) -> dict[str, float]:
        """The XLA programs compiled and loaded from the compile cache since `clear` (compile_cache.programs): what
        a first job spends compiling, and whether a later one loaded its programs instead."""
        return compile_cache.programs_since(self.programs_before)

    def summary(self, max_seqs: int) -> dict[str, float]:
        """p50/p90/max step time (ms); the loop's wall time from the first step's start to the last one's end,
        split into device calls and host work between and around them (s); prefill and decode tokens/s over
        the steps; mean and peak slot occupancy (fraction of max_seqs); mean forward passes per step (device
        call); the prefix cache's query and hit tokens and hit rate; the bytes moved between host and device
        (`transfers`); the programs compiled and loaded (`programs`)."""
        if not self.step_s:
            return {"steps": 0, **self.prefix_cache(), **self.host_kv(), **self.transfers(), **self.programs()}
        t = np.asarray(self.step_s)
        total = float(t.sum())
        wall = self.last_end - self.first_start
        device = float(sum(self.device_s))
        return {
            "steps": len(t),
            "step_ms_p50": float(np.percentile(t, 50) * 1e3),
            "step_ms_p90": float(np.percentile(t, 90) * 1e3),
            "step_ms_max": float(t.max() * 1e3),
            "wall_s": wall,
            "device_s": device,
            "host_s": wall - device,
            "prefill_tokens_per_s": sum(self.prefill_tokens) / total,
            "decode_tokens_per_s": sum(self.decode_tokens) / total,
            "mean_slot_occupancy": float(np.mean(self.active_seqs)) / max_seqs,
            "max_slot_occupancy": max(self.active_seqs) / max_seqs,
            "mean_model_steps": float(np.mean(self.model_steps)),
            **self.prefix_cache(),
            **self.host_kv(),
            **self.transfers(),
            **self.programs(),
        }


def prefix_cache_summary(query_tokens: int, hit_tokens: int) -> dict[str, float]:
    """The prefix cache's figures under the names every report uses (generate's summary, timeline, status, W&B)."""
    return {"prefix_cache_query_tokens": query_tokens, "prefix_cache_hit_tokens": hit_tokens,
            "prefix_cache_hit_rate": hit_tokens / query_tokens if query_tokens else 0.0}


HOST_KV_SUMS = ("kv_pages_out", "kv_pages_in", "kv_pages_in_ahead", "recompute_avoided_tokens", "recompute_tokens")
"""Preemption's counts under the names every report uses (generate's summary and --stats_output, timeline.jsonl,
the run's summary and W&B, `pagefleet status`): summed over steps, buckets and slices."""
HOST_KV_PEAK = "host_kv_pages_peak"
"""The host pool's peak use (pages) in every report: the largest over steps, buckets and slices (one slice's pool)."""


def host_kv_counters(summary: dict) -> dict[str, int]:
    """Preemption's figures out of an `EngineStats.summary` (a timeline bucket's)."""
    return {k: summary[k] for k in HOST_KV_SUMS + (HOST_KV_PEAK,)}


def host_kv_summary(figures: list[dict]) -> dict[str, int]:
    """Preemption's figures over several reports (timeline buckets): the counts summed, the peak the largest."""
    return {**{k: sum(f.get(k, 0) for f in figures) for k in HOST_KV_SUMS},
            HOST_KV_PEAK: max((f.get(HOST_KV_PEAK, 0) for f in figures), default=0)}


class StepTimer:
    """Context manager that records one step (one device call) into EngineStats: its wall time, its time in
    device calls, the bytes its transfer ledger counted (the step is the ledger's device call), and the counts
    the engine sets before the block ends (sequences that ran, prompt or recomputed tokens, tokens drawn,
    forward passes)."""

    def __init__(self, stats: EngineStats, clock: DeviceClock, transfers: TransferLedger) -> None:
        self.stats = stats
        self.clock = clock
        self.transfers = transfers
        self.active_seqs = 0
        self.prefill_tokens = 0
        self.decode_tokens = 0
        self.model_steps = 1

    def __enter__(self) -> "StepTimer":
        self.start = time.perf_counter()
        self.device_start = self.clock.total_s
        if self.stats.first_start is None:
            self.stats.first_start = self.start
        return self

    def __exit__(self, *exc) -> None:
        end = time.perf_counter()
        self.stats.step_s.append(end - self.start)
        self.stats.device_s.append(self.clock.total_s - self.device_start)
        self.stats.last_end = end
        self.stats.decode_tokens.append(self.decode_tokens)
        self.stats.prefill_tokens.append(self.prefill_tokens)
        self.stats.active_seqs.append(self.active_seqs)
        self.stats.model_steps.append(self.model_steps)
        d2h, h2d = self.transfers.end_call()
        for totals, counts in ((self.stats.device_to_host_bytes, d2h), (self.stats.host_to_device_bytes, h2d)):
            for category, n in counts.items():
                totals[category] = totals.get(category, 0) + n
