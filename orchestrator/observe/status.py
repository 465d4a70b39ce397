"""`pagefleet status RUN_DIR`: what the run directory says, read without disturbing a running head."""

from __future__ import annotations

import fcntl
import json
import os
import time
from pathlib import Path

from orchestrator.observe.run_summary import RunSummary
from orchestrator.observe.timeline import figure_lines
from orchestrator.state.manifest import manifest_totals, read_manifest, read_totals
from orchestrator.state.manifest_check import check_manifest
from orchestrator.state.object_lock import holder
from orchestrator.state.rundir import RunDir
from orchestrator.storage.location import Location, location


def head_holding(run_dir: RunDir) -> dict | None:
    """The head that holds the run directory's lock now ({pid, host, since}), or None."""
    if isinstance(run_dir.root, Location):
        return holder(str(run_dir.root))
    path = run_dir.root / ".lock"
    if not path.exists():
        return None
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        text = os.pread(fd, 4096, 0).decode(errors="replace").strip()
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            return {"pid": None, "host": None, "since": None}
    finally:
        os.close(fd)  # closing drops a shared lock we may have taken
    return None


def status(run_dir_path: str | Path) -> dict:
    """The run's figures as `pagefleet status --json` gives them (RunSummary.status_figures)."""
    run_dir = RunDir(location(run_dir_path))
    if not run_dir.manifest.exists():
        raise FileNotFoundError(f"{run_dir.manifest} not found: {run_dir.root} is not a planned run directory "
                                "(`pagefleet plan CONFIG` or `pagefleet run CONFIG` makes one)")
    totals = read_totals(run_dir.manifest)  # those the head wrote with this very manifest (checked when written)
    if totals is None:  # else every line: a manifest that disagrees with the plan is named, never counted
        records = read_manifest(run_dir.manifest)
        check_manifest(run_dir, records)
        totals = manifest_totals(records)
    return RunSummary.read(run_dir, totals=totals).status_figures(head_holding(run_dir))


def format_status(s: dict) -> str:
    c = s["counts"]
    head = s["head"]
    lines = [
        f"run directory  {s['run_dir']}",
        "head           " + (f"running (pid {head.get('pid')} on {head.get('host')})" if head else "none (not running)"),
        f"batches        {c['done']:,} done, {c['running']:,} running, {c['pending']:,} pending, {c['failed']:,} failed"
        f" of {s['batches']:,}",
        f"prompts        {s['prompts_done']:,} of {s['prompts']:,} done; {s['rows_rejected']:,} rows rejected (rejected.jsonl)",
        f"samples        {s['samples_done']:,} done, {s['output_tokens_done']:,} output tokens",
    ]
    if s["tokens_per_s"] is not None:
        age = time.time() - (s["progress_updated_at"] or time.time())
        lines.append(f"throughput     {s['tokens_per_s']:,.1f} tokens/s (latest head session, updated {age:,.0f} s ago)")
    if s.get("fault"):
        lines.append(f"stopped on     {s['fault']}")
    if s.get("waiting"):
        lines.append(f"waiting        {s['waiting']}")
    if s["eta_s"] is not None:
        lines.append(f"eta            {s['eta_s'] / 60:,.1f} min")
    split = (s["engine_time"]["device_s"], s["engine_time"]["host_s"]) if s["engine_time"] else None
    lines += [f"{label:<15}{text}" for label, text in figure_lines(
        s["mean_occupancy"], split, s["prefix_cache"], s["preemption"], s["transfers"], s.get("programs"))]
    for f in s["failed"]:
        lines.append(f"failed {f['batch_id']} after {f['attempts']} attempts:")
        lines += [f"    {line}" for line in (f["error"] or "").strip().splitlines()[-6:]]
    return "\n".join(lines)
