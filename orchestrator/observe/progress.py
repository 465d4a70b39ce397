"""The head's live figures: a progress bar, progress.json for `status`, the timeline, the final summary."""

from __future__ import annotations

import json
import os
import socket
import sys
import time

from engine import (HOST_KV_PEAK, TRANSFER_DIRECTIONS, host_kv_summary, prefix_cache_summary, sum_transfer_counters,
                    transfer_counter_key, transfer_summary)
from orchestrator.storage import object_append, storage
from orchestrator.storage.atomic import atomic_write_text
from orchestrator.json_out import dumps
from orchestrator.run.manifest import BatchRecord
from orchestrator.run.rundir import RunDir

PROGRESS_EVERY_S = 5.0
LINE_EVERY_ENV = "PAGEFLEET_PROGRESS_EVERY_S"
LINE_EVERY_S = 30.0
"""Seconds between plain progress lines when stderr is not a terminal (`PAGEFLEET_PROGRESS_EVERY_S` overrides)."""


def line_every_s() -> float:
    value = os.environ.get(LINE_EVERY_ENV, "").strip()
    try:
        return max(0.1, float(value)) if value else LINE_EVERY_S
    except ValueError:
        raise ValueError(f"{LINE_EVERY_ENV}={value!r} is not a number of seconds") from None


class RunProgress:
    """Progress on stderr when `show` is true: a live bar on a terminal, else (a file, `ray job logs`) a plain
    line every `line_every_s()` seconds, never carriage-return bars."""

    def __init__(self, run_dir: RunDir, records: list[BatchRecord], show: bool, stream=None) -> None:
        from tqdm import tqdm

        stream = stream or sys.stderr
        show_bar = show and stream.isatty()
        self._stream = stream
        self._lines = show and not show_bar
        self._line_every_s = line_every_s()
        self._next_line = time.monotonic() + self._line_every_s
        self.waiting: str | None = None
        """Why slices have not started (resources the cluster lacks), shown in the lines and progress.json."""
        self.batches_done = sum(r.status == "done" for r in records)
        self.batches_failed = 0

        self.run_dir = run_dir
        self.started = time.time()
        self.total_prompts = sum(r.num_prompts for r in records)
        self.total_batches = len(records)
        self.session_prompts = 0
        self.session_tokens = 0
        self.session_batches = 0
        self._last_write = 0.0
        done = [r for r in records if r.status == "done"]
        self.bar = tqdm(total=self.total_prompts, initial=sum(r.num_prompts for r in done), unit="prompt",
                        desc="prompts", file=stream, disable=not show_bar, dynamic_ncols=True, smoothing=0.1)
        self._timeline = object_append.open_append(run_dir.timeline)  # local file, or rewritten whole on gs://

    def batch_done(self, record: BatchRecord, num_done_batches: int, num_failed: int) -> None:
        self.session_prompts += record.num_prompts
        self.session_tokens += record.num_output_tokens
        self.session_batches += 1
        self.batches_done, self.batches_failed = num_done_batches, num_failed
        self.bar.update(record.num_prompts)
        self.bar.set_postfix_str(f"batches {num_done_batches}/{self.total_batches}, "
                                 f"{self.tokens_per_s:,.0f} tok/s, failed {num_failed}", refresh=False)

    def add_timeline(self, slice_name: str, buckets: list[dict]) -> None:
        for b in buckets:  # an engine of a data-parallel slice is a line of its own: "slice-0/1"
            name = slice_name if "engine" not in b else f"{slice_name}/{b['engine']}"
            self._timeline.write(dumps({**b, "slice": name, "session": self.started}) + "\n")
        if buckets:
            self._timeline.flush()

    @property
    def elapsed_s(self) -> float:
        return time.time() - self.started

    @property
    def tokens_per_s(self) -> float:
        return self.session_tokens / max(self.elapsed_s, 1e-9)

    def eta_s(self, remaining_prompts: int) -> float | None:
        if not self.session_prompts:
            return None
        return remaining_prompts / (self.session_prompts / max(self.elapsed_s, 1e-9))

    def line(self, remaining_prompts: int) -> str:
        """One plain progress line: prompts and batches done, tokens/s, ETA (and what slices wait for)."""
        done = self.total_prompts - remaining_prompts
        eta = self.eta_s(remaining_prompts)
        text = (f"progress: {done:,}/{self.total_prompts:,} prompts ({done / max(self.total_prompts, 1):.1%}), "
                f"batches {self.batches_done:,}/{self.total_batches:,} done, {self.batches_failed:,} failed, "
                f"{self.tokens_per_s:,.1f} tokens/s, ETA " + (f"{eta / 60:,.1f} min" if eta is not None else "unknown"))
        return text + (f"; {self.waiting}" if self.waiting else "")

    def write(self, remaining_prompts: int, force: bool = False, running: bool = True) -> None:
        """Replace progress.json (every PROGRESS_EVERY_S, or now when forced); print a plain line when due, and
        always for the last write of a session (`running` false), so that a log ends with where the run stands."""
        if self._lines and (time.monotonic() >= self._next_line or not running):
            self._next_line = time.monotonic() + self._line_every_s
            print(self.line(remaining_prompts), file=self._stream, flush=True)
        if not force and time.monotonic() - self._last_write < PROGRESS_EVERY_S:
            return
        self._last_write = time.monotonic()
        atomic_write_text(self.run_dir.progress, dumps({
            "updated_at": time.time(), "head": {"pid": os.getpid(), "host": socket.gethostname()},
            "running": running, "session_started_at": self.started, "session_elapsed_s": self.elapsed_s,
            "session_batches": self.session_batches, "session_prompts": self.session_prompts,
            "session_output_tokens": self.session_tokens, "tokens_per_s": self.tokens_per_s,
            "prompts_per_s": self.session_prompts / max(self.elapsed_s, 1e-9), "eta_s": self.eta_s(remaining_prompts),
            "waiting": self.waiting if running else None,
        }, indent=1) + "\n")

    def close(self) -> None:
        self.bar.close()
        self._timeline.close()


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


def format_engine_time(split: tuple[float, float]) -> str:
    device, host = split
    return (f"device calls {device:,.1f} s, host work {host:,.1f} s, summed over slices "
            f"({host / max(device + host, 1e-9):.0%} of the engine loop on the host)")
