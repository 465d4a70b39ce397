"""`pagefleet status RUN_DIR`: what the run directory says, read without disturbing a running head."""

from __future__ import annotations

import fcntl
import json
import os
import time
from collections import Counter
from pathlib import Path

from orchestrator.run.manifest import read_manifest
from orchestrator.observe.progress import (engine_time, format_engine_time, format_host_kv, format_prefix_cache, format_transfers,
                                   host_kv, mean_occupancy, prefix_cache, read_timeline, transfers)
from orchestrator.run.rundir import RunDir
from orchestrator.storage.location import Location, location


def head_holding(run_dir: RunDir) -> dict | None:
    """The head that holds the run directory's lock now ({pid, host, since}), or None."""
    if isinstance(run_dir.root, Location):
        from orchestrator.run.object_lock import holder

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
    run_dir = RunDir(location(run_dir_path))
    if not run_dir.manifest.exists():
        raise FileNotFoundError(f"{run_dir.manifest} not found: {run_dir.root} is not a planned run directory "
                                "(`pagefleet plan CONFIG` or `pagefleet run CONFIG` makes one)")
    records = read_manifest(run_dir.manifest)
    counts = Counter(r.status for r in records)
    done = [r for r in records if r.status == "done"]
    progress = json.loads(run_dir.progress.read_text()) if run_dir.progress.exists() else {}
    head = head_holding(run_dir)
    remaining = sum(r.num_prompts for r in records if r.status != "done")
    rate = progress.get("prompts_per_s") or 0.0
    plan = run_dir.read_run_json().get("plan", {}) if run_dir.run_json.exists() else {}
    timeline = read_timeline(run_dir)
    return {
        "run_dir": str(run_dir.root),
        "head": head,
        "counts": {s: counts.get(s, 0) for s in ("pending", "running", "done", "failed")},
        "batches": len(records),
        "prompts": sum(r.num_prompts for r in records),
        "prompts_done": sum(r.num_prompts for r in done),
        "rows_rejected": plan.get("rows_read", 0) - plan.get("accepted", 0),
        "samples_done": sum(r.num_samples for r in done),
        "output_tokens_done": sum(r.num_output_tokens for r in done),
        "tokens_per_s": progress.get("tokens_per_s"),
        "eta_s": (remaining / rate if rate else None) if head else None,
        "progress_updated_at": progress.get("updated_at"),
        "waiting": progress.get("waiting") if head else None,
        "mean_occupancy": mean_occupancy(timeline),
        "engine_time": dict(zip(("device_s", "host_s"), split)) if (split := engine_time(timeline)) else None,
        "prefix_cache": prefix_cache(timeline),
        "preemption": host_kv(timeline),
        "transfers": transfers(timeline),
        "failed": [{"batch_id": r.batch_id, "attempts": r.attempts, "error": r.error}
                   for r in records if r.status == "failed"],
    }


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
    if s.get("waiting"):
        lines.append(f"waiting        {s['waiting']}")
    if s["eta_s"] is not None:
        lines.append(f"eta            {s['eta_s'] / 60:,.1f} min")
    if s["mean_occupancy"] is not None:
        lines.append(f"slot occupancy {s['mean_occupancy']:.1%} of engine.max_seqs (mean over engine steps)")
    if s["engine_time"] is not None:
        lines.append(f"engine time    {format_engine_time((s['engine_time']['device_s'], s['engine_time']['host_s']))}")
    if s["prefix_cache"] is not None:
        lines.append(f"prefix cache   {format_prefix_cache(s['prefix_cache'])}")
    if s["preemption"] is not None:
        lines.append(f"preemption     {format_host_kv(s['preemption'])}")
    if s["transfers"] is not None:
        lines.append(f"transfers      {format_transfers(s['transfers'])}")
    for f in s["failed"]:
        lines.append(f"failed {f['batch_id']} after {f['attempts']} attempts:")
        lines += [f"    {line}" for line in (f["error"] or "").strip().splitlines()[-6:]]
    return "\n".join(lines)
