"""The run's timeline (timeline.jsonl: one line per slice per second of engine steps, every head session) and
its figures over the whole run, every slice summed, with the one-line text each is shown as."""

from __future__ import annotations

import json

from engine import (HOST_KV_PEAK, PROGRAM_FIGURES, TRANSFER_DIRECTIONS, host_kv_summary, prefix_cache_summary,
                    sum_transfer_counters, transfer_counter_key, transfer_summary)
from orchestrator.state.rundir import RunDir
from orchestrator.storage import storage


def read_timeline(run_dir: RunDir) -> list[dict]:
    """Every timeline bucket of every session (a line cut short by a crash is skipped)."""
    if not run_dir.timeline.exists():
        return []
    out = []
    with storage.open_file(run_dir.timeline, "rb") as f:  # local or gs://
        for line in f:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def mean_occupancy(timeline: list[dict]) -> float | None:
    """Live sequences per engine step over the whole run, as a fraction of max_seqs (step-weighted)."""
    steps = sum(b.get("steps", 1) for b in timeline)
    if not steps:
        return None
    return sum(b["occupancy"] * b.get("steps", 1) for b in timeline) / steps


def engine_time(timeline: list[dict]) -> tuple[float, float] | None:
    """(device_s, host_s): the engine loop's time in device calls and in host work (scheduling, input packing,
    stop checks, the slice's bookkeeping) over the whole run, every slice summed; None before any bucket has
    them. A large host share says the slice waits on Python, not on the accelerator."""
    timed = [b for b in timeline if "device_s" in b]
    if not timed:
        return None
    return sum(b["device_s"] for b in timed), sum(b["host_s"] for b in timed)


def prefix_cache(timeline: list[dict]) -> dict[str, float] | None:
    """The prefix cache over the whole run, every slice summed: prompt tokens looked up, tokens served from
    cached pages, and the hit rate; None before any bucket has them."""
    counted = [b for b in timeline if "prefix_cache_query_tokens" in b]
    if not counted:
        return None
    return prefix_cache_summary(sum(b["prefix_cache_query_tokens"] for b in counted),
                                sum(b["prefix_cache_hit_tokens"] for b in counted))


def host_kv(timeline: list[dict]) -> dict[str, int] | None:
    """Preemption over the whole run, every slice summed: KV pages swapped out and in, tokens whose recompute a
    swap avoided, tokens preemptions dropped for recompute, the host pool's peak use; None before any bucket
    has them."""
    counted = [b for b in timeline if HOST_KV_PEAK in b]
    return host_kv_summary(counted) if counted else None


def format_host_kv(figures: dict[str, float]) -> str:
    return (f"{figures['kv_pages_out']:,} KV pages swapped out, {figures['kv_pages_in']:,} in; recompute of "
            f"{figures['recompute_avoided_tokens']:,} tokens avoided, {figures['recompute_tokens']:,} tokens "
            f"dropped for recompute; host pool peak {figures['host_kv_pages_peak']:,} pages")


def transfers(timeline: list[dict]) -> dict[str, float] | None:
    """The bytes the engine loops moved between host and device over the whole run, every slice summed: per
    direction the total, by category, and per generated token; None before any bucket has them."""
    counted = [b for b in timeline if "decode_tokens" in b]  # buckets written with the transfer counters
    if not counted:
        return None
    return transfer_summary(*sum_transfer_counters(counted), sum(b["decode_tokens"] for b in counted))


def format_transfers(figures: dict[str, float]) -> str:
    """One line: device-to-host bytes (the figure that must stay small: no KV page, no logits) by category with
    bytes per generated token, then host-to-device bytes."""
    def by_category(direction: str) -> str:
        parts = [f"{c} {n:,}" for c in TRANSFER_DIRECTIONS[direction]
                 if (n := figures[transfer_counter_key(direction, c)])]
        return (f"{figures[f'{direction}_bytes']:,} B" + (f" ({', '.join(parts)})" if parts else "") +
                f", {figures[f'{direction}_bytes_per_token']:,.1f} B per generated token")
    return f"device to host {by_category('device_to_host')}; host to device {by_category('host_to_device')}"


def format_prefix_cache(figures: dict[str, float]) -> str:
    return (f"{figures['prefix_cache_hit_tokens']:,} of {figures['prefix_cache_query_tokens']:,} prompt tokens served "
            f"from cached pages ({figures['prefix_cache_hit_rate']:.1%} hit rate)")


def programs(timeline: list[dict]) -> dict[str, float] | None:
    """The XLA programs the engines compiled and loaded from the compile cache over the whole run, every slice summed
    (docs/caches.md); None before any bucket has them."""
    counted = [b for b in timeline if PROGRAM_FIGURES[0] in b]
    return {k: sum(b[k] for b in counted) for k in PROGRAM_FIGURES} if counted else None


def format_programs(figures: dict[str, float]) -> str:
    """One line: the XLA programs compiled and those loaded from the compile cache (docs/caches.md)."""
    return (f"{figures['programs_compiled']:,} compiled ({figures['compile_s']:.1f} s), {figures['programs_loaded']:,} "
            f"loaded from the compile cache ({figures['program_load_s']:.1f} s); tracing and lowering "
            f"{figures['trace_lower_s']:.1f} s")


def format_engine_time(split: tuple[float, float]) -> str:
    device, host = split
    return (f"device calls {device:,.1f} s, host work {host:,.1f} s, summed over slices "
            f"({host / max(device + host, 1e-9):.0%} of the engine loop on the host)")


def figure_lines(occupancy: float | None, split: tuple[float, float] | None, cache: dict | None, swaps: dict | None,
                 moved: dict | None, compiled: dict | None = None) -> list[tuple[str, str]]:
    """(label, text) for each timeline figure there is: the lines the run's summary and `status` print alike."""
    lines = []
    if occupancy is not None:
        lines.append(("slot occupancy", f"{occupancy:.1%} of engine.max_seqs (mean over engine steps)"))
    if split is not None:
        lines.append(("engine time", format_engine_time(split)))
    if cache is not None:
        lines.append(("prefix cache", format_prefix_cache(cache)))
    if swaps is not None:
        lines.append(("preemption", format_host_kv(swaps)))
    if moved is not None:
        lines.append(("transfers", format_transfers(moved)))
    if compiled is not None:
        lines.append(("programs", format_programs(compiled) + ", summed over slices"))
    return lines
