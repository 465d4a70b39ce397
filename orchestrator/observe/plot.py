"""The end-of-run plot: output tokens/s and slot occupancy over time, one line per slice.

Drawn with matplotlib's object API on the Agg canvas (no pyplot, no display, no global backend
switch), so the head can call it from any thread.

A resumed run's timeline has holes where no head ran: lines break there and the hole is shaded,
never bridged by a held rate. The summary's tokens/s (a session's output tokens over its wall time,
start-up and batch boundaries included) is drawn as its own dashed line, so the gap between it and
the peak of the per-bucket rates is on the figure, with the reason.
"""

from __future__ import annotations

import bisect
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from orchestrator.storage.atomic import atomic_write
from orchestrator.storage.location import Location
from orchestrator.storage.storage import is_object_store

STOP_GAP_MIN_S = 30.0
"""Without session marks (older timelines), a silence this long, and ten times a slice's usual interval, is a stop."""

NAN = float("nan")


def by_slice(timeline: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Timeline entries grouped by slice, each slice's entries in time order."""
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for entry in timeline:
        groups[str(entry["slice"])].append(entry)
    return {name: sorted(entries, key=lambda e: e["t"]) for name, entries in sorted(groups.items())}


def segments(entries: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """A slice's entries (in time order) cut where the run stopped: a new head session (`session`), or for
    entries without one a silence of more than max(STOP_GAP_MIN_S, 10 x the slice's median interval)."""
    if not entries:
        return []
    gaps = [b["t"] - a["t"] for a, b in zip(entries, entries[1:])]
    limit = max(STOP_GAP_MIN_S, 10 * statistics.median(gaps)) if gaps else STOP_GAP_MIN_S
    out = [[entries[0]]]
    for prev, entry in zip(entries, entries[1:]):
        if "session" in prev and "session" in entry:
            stopped = prev["session"] != entry["session"]
        else:
            stopped = entry["t"] - prev["t"] > limit
        if stopped:
            out.append([entry])
        else:
            out[-1].append(entry)
    return out


def series(entries: list[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    """(times, values) of one slice, with a NaN point between segments so that a line breaks there."""
    times: list[float] = []
    values: list[float] = []
    for i, segment in enumerate(segments(entries)):
        if i:
            times.append(float(segment[0]["t"]))
            values.append(NAN)
        times += [float(e["t"]) for e in segment]
        values += [float(e[key]) for e in segment]
    return times, values


def stopped_spans(slices: dict[str, list[dict[str, Any]]]) -> list[tuple[float, float]]:
    """(start, end) of every stretch where no slice of any session was live (the run was stopped)."""
    spans = sorted((float(s[0]["t"]), float(s[-1]["t"])) for entries in slices.values() for s in segments(entries))
    out = []
    if spans:
        end = spans[0][1]
        for lo, hi in spans[1:]:
            if lo > end:
                out.append((end, lo))
            end = max(end, hi)
    return out


def total_tokens_per_s(slices: dict[str, list[dict[str, Any]]]) -> tuple[list[float], list[float]]:
    """(times, summed tokens/s) at every entry time of any slice.

    Each slice contributes its latest value at or before `t` (its entries are rates held until the
    next one) within a segment, and nothing after a segment's last entry (a slice that has finished,
    or a stopped run, adds no throughput). Where the run was stopped, a NaN point right after the last
    entry before the stop breaks the line instead of holding the last rate across the hole.
    """
    series_ = [([float(e["t"]) for e in seg], [float(e["tokens_per_s"]) for e in seg])
               for entries in slices.values() for seg in segments(entries)]
    times = sorted({t for ts, _ in series_ for t in ts})
    totals = []
    for t in times:
        total = 0.0
        for ts, rates in series_:
            i = bisect.bisect_right(ts, t) - 1
            if i >= 0 and t <= ts[-1]:
                total += rates[i]
        totals.append(total)
    for start, _ in reversed(stopped_spans(slices)):
        at = bisect.bisect_right(times, start)
        times.insert(at, start)
        totals.insert(at, NAN)
    return times, totals


def write_plot(path: Path | Location, timeline: list[dict[str, Any]], mean_tokens_per_s: float | None = None) -> None:
    """Write a PNG at `path` (atomically): tokens/s (per slice and total) and occupancy over time.

    `timeline` entries: `t` (seconds since run start), `slice` (name), `tokens_per_s` (output tokens
    per second), `occupancy` (mean fraction of the slice's max_seqs slots in use, 0..1), and `session`
    (the head session that recorded it; optional). `mean_tokens_per_s`: the summary's rate of the latest
    session, drawn dashed. An empty timeline gives a PNG that says "no steps".
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 6), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    if not timeline:
        fig.text(0.5, 0.5, "no steps", ha="center", va="center", fontsize=20)
    else:
        ax_rate, ax_occ = fig.subplots(2, 1, sharex=True)
        slices = by_slice(timeline)
        for name, entries in slices.items():
            ax_rate.plot(*series(entries, "tokens_per_s"), label=name, linewidth=1)
            ax_occ.plot(*series(entries, "occupancy"), label=name, linewidth=1)
        if len(slices) > 1:
            ax_rate.plot(*total_tokens_per_s(slices), label="total", color="black", linewidth=2,
                         drawstyle="steps-post")  # rates are held until the next entry
        else:
            ax_rate.lines[0].set_label(f"{next(iter(slices))} (total)")
        for i, (start, end) in enumerate(stopped_spans(slices)):
            for ax in (ax_rate, ax_occ):
                ax.axvspan(start, end, color="grey", alpha=0.15, label="stopped" if i == 0 and ax is ax_rate else None)
        if mean_tokens_per_s is not None:
            ax_rate.axhline(mean_tokens_per_s, color="tab:red", linestyle="--", linewidth=1,
                            label=f"summary: {mean_tokens_per_s:,.1f} tokens/s")
            ax_rate.set_title("per-bucket rates peak above the summary's, which divides a session's output tokens by "
                              "its wall time, start-up and batch boundaries included", fontsize="small", wrap=True)
        ax_rate.set_ylabel("output tokens/s")
        ax_rate.set_ylim(bottom=0)
        ax_rate.legend(loc="best", fontsize="small")
        ax_occ.set_ylabel("slot occupancy\n(fraction of max_seqs)")
        ax_occ.set_ylim(0, 1.05)
        ax_occ.set_xlabel("seconds since run start")
        for ax in (ax_rate, ax_occ):
            ax.grid(True, alpha=0.3)
    if not is_object_store(str(path)):  # a gs:// run directory (a Location) has no folders to make
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png"))
