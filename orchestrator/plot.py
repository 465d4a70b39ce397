"""The end-of-run plot: output tokens/s and slot occupancy over time, one line per slice.

Drawn with matplotlib's object API on the Agg canvas (no pyplot, no display, no global backend
switch), so the head can call it from any thread.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from pathlib import Path
from typing import Any

from orchestrator.atomic import atomic_write


def by_slice(timeline: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Timeline entries grouped by slice, each slice's entries in time order."""
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for entry in timeline:
        groups[str(entry["slice"])].append(entry)
    return {name: sorted(entries, key=lambda e: e["t"]) for name, entries in sorted(groups.items())}


def total_tokens_per_s(slices: dict[str, list[dict[str, Any]]]) -> tuple[list[float], list[float]]:
    """(times, summed tokens/s) at every entry time of any slice.

    Each slice contributes its latest value at or before `t` (its entries are rates held until the
    next one), and nothing after its last entry (a slice that has finished adds no throughput).
    """
    series = [([float(e["t"]) for e in entries], [float(e["tokens_per_s"]) for e in entries])
              for entries in slices.values()]
    times = sorted({t for ts, _ in series for t in ts})
    totals = []
    for t in times:
        total = 0.0
        for ts, rates in series:
            i = bisect.bisect_right(ts, t) - 1
            if i >= 0 and t <= ts[-1]:
                total += rates[i]
        totals.append(total)
    return times, totals


def write_plot(path: Path, timeline: list[dict[str, Any]]) -> None:
    """Write a PNG at `path` (atomically): tokens/s (per slice and total) and occupancy over time.

    `timeline` entries: `t` (seconds since run start), `slice` (name), `tokens_per_s` (output tokens
    per second), `occupancy` (mean fraction of the slice's max_seqs slots in use, 0..1). An empty
    timeline gives a PNG that says "no steps".
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
            ts = [float(e["t"]) for e in entries]
            ax_rate.plot(ts, [float(e["tokens_per_s"]) for e in entries], label=name, linewidth=1)
            ax_occ.plot(ts, [float(e["occupancy"]) for e in entries], label=name, linewidth=1)
        if len(slices) > 1:
            ax_rate.plot(*total_tokens_per_s(slices), label="total", color="black", linewidth=2,
                         drawstyle="steps-post")  # rates are held until the next entry
        else:
            ax_rate.lines[0].set_label(f"{next(iter(slices))} (total)")
        ax_rate.set_ylabel("output tokens/s")
        ax_rate.set_ylim(bottom=0)
        ax_rate.legend(loc="best", fontsize="small")
        ax_occ.set_ylabel("slot occupancy\n(fraction of max_seqs)")
        ax_occ.set_ylim(0, 1.05)
        ax_occ.set_xlabel("seconds since run start")
        for ax in (ax_rate, ax_occ):
            ax.grid(True, alpha=0.3)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png"))
