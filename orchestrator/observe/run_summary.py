"""One run's figures, computed once. The summary `pagefleet run` prints and returns, W&B's run summary,
`pagefleet status` (text and --json, and so the service's run status) and the plot's summary line are views
of one `RunSummary`.

The figures come from the run directory's durable state: the manifest (batches.jsonl: counts, prompts, samples,
output tokens, failed batches), run.json's plan (rows rejected at planning), progress.json (the latest head session:
its batches, output tokens, wall time, tokens/s) and timeline.jsonl (occupancy, engine time, prefix cache,
preemption, transfers, programs compiled, summed over every session and slice). The head passes the totals and
session figures it has just written, so that a disk that refused the last write cannot make its summary lag;
`status` reads the same files.

Each output keeps the names its users read (docs/tracking.md, docs/run-directory.md): the run summary says
`output_tokens`, `batches_done`, `engine_device_s`, flat prefix-cache / preemption / transfer keys; `status
--json` says `output_tokens_done`, `counts.done`, `engine_time.device_s`, nested `prefix_cache`, `preemption`,
`transfers`, `programs`. The views below are the one place that maps a figure to those names.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from orchestrator.observe.timeline import (engine_time, figure_lines, host_kv, mean_occupancy, prefix_cache, programs,
                                           read_timeline, transfers)
from orchestrator.state.manifest import STATUSES, manifest_totals, read_manifest, read_totals
from orchestrator.state.rundir import RunDir

_READ = object()  # RunSummary.read's default session: read progress.json


def eta_s(remaining_prompts: int, prompts_per_s: float | None) -> float | None:
    """Seconds left at a session's prompt rate; None before the session has finished any prompt."""
    return remaining_prompts / prompts_per_s if prompts_per_s else None


@dataclass(frozen=True)
class FailedBatch:
    batch_id: str
    attempts: int
    error: str | None


@dataclass(frozen=True)
class RunSummary:
    run_dir: str
    counts: dict[str, int]
    """Batches per status: pending, running, done, failed."""
    prompts: int
    prompts_done: int
    rows_rejected: int
    """Input rows the planner rejected (rejected.jsonl)."""
    samples_done: int
    output_tokens: int
    """Output tokens of the done batches: the run's total, every session."""
    failed: tuple[FailedBatch, ...]
    session: dict[str, Any] | None
    """The latest head session's figures as progress.json holds them (session_batches, session_output_tokens,
    session_elapsed_s, tokens_per_s, prompts_per_s, updated_at, waiting); None where no session ran."""
    mean_occupancy: float | None
    engine_time: tuple[float, float] | None
    """(device_s, host_s) of the engine loops."""
    prefix_cache: dict[str, float] | None
    preemption: dict[str, int] | None
    transfers: dict[str, float] | None
    programs: dict[str, float] | None = None
    """The XLA programs the engines compiled and loaded (docs/caches.md)."""

    @classmethod
    def read(cls, run_dir: RunDir, session: Any = _READ, timeline: list[dict] | None = None,
             totals: dict | None = None) -> RunSummary:
        """The run directory's figures. The head passes the manifest's `totals` (manifest_totals of what it has just
        written, RunState.totals) and its `session` figures (those it has just written to progress.json; None for a
        head that ran no session); left out, both are read from the directory (the totals the head wrote beside the
        manifest, read_totals, else the manifest itself), as is `timeline` (read_timeline)."""
        if totals is None:
            totals = read_totals(run_dir.manifest) or manifest_totals(read_manifest(run_dir.manifest))
        if session is _READ:
            session = _read_json(run_dir.progress)
        if timeline is None:
            timeline = read_timeline(run_dir)
        plan = run_dir.read_run_json().get("plan", {}) if run_dir.run_json.exists() else {}
        return cls(
            run_dir=str(run_dir.root), counts={s: totals["counts"].get(s, 0) for s in STATUSES},
            prompts=totals["prompts"], prompts_done=totals["prompts_done"],
            rows_rejected=plan.get("rows_read", 0) - plan.get("accepted", 0),
            samples_done=totals["samples_done"], output_tokens=totals["output_tokens"],
            failed=tuple(FailedBatch(*f) for f in totals["failed"]),
            session=session, mean_occupancy=mean_occupancy(timeline), engine_time=engine_time(timeline),
            prefix_cache=prefix_cache(timeline), preemption=host_kv(timeline), transfers=transfers(timeline),
            programs=programs(timeline))

    @property
    def batches(self) -> int:
        return sum(self.counts.values())

    @property
    def batches_pending(self) -> int:
        """Batches not done and not failed: pending, or running when the head stopped."""
        return self.counts["pending"] + self.counts["running"]

    @property
    def tokens_per_s(self) -> float | None:
        """The latest session's output tokens over its wall time, start-up and batch boundaries included."""
        return None if self.session is None else self.session.get("tokens_per_s")

    def _session(self, key: str, default: Any = 0) -> Any:
        return default if self.session is None else self.session.get(key, default)

    # -- views -----------------------------------------------------------------------------------

    def run_figures(self) -> dict[str, Any]:
        """What `pagefleet run` returns (RunOutcome.summary, pagefleet.run): the run's totals, and its latest
        session's where one ran."""
        out: dict[str, Any] = {
            "run_dir": self.run_dir, "batches": self.batches, "batches_done": self.counts["done"],
            "batches_failed": self.counts["failed"], "batches_pending": self.batches_pending,
            "prompts_done": self.prompts_done, "prompts": self.prompts, "rows_rejected": self.rows_rejected,
            "samples_done": self.samples_done, "output_tokens": self.output_tokens,
            "session_s": self._session("session_elapsed_s", 0.0),
            "failed": {b.batch_id: b.error for b in self.failed},
        }
        if self.session is not None:
            out["session_batches"] = self._session("session_batches")
            out["session_output_tokens"] = self._session("session_output_tokens")
            out["tokens_per_s"] = self.tokens_per_s
        if self.mean_occupancy is not None:
            out["mean_occupancy"] = self.mean_occupancy
        if self.engine_time is not None:
            out["engine_device_s"], out["engine_host_s"] = self.engine_time
        for figures in (self.prefix_cache, self.preemption, self.transfers, self.programs):
            out.update(figures or {})
        return out

    def tracker_figures(self) -> dict[str, int | float | str]:
        """W&B's run summary: the run figures that are numbers or text (totals, never a batch's values)."""
        return {k: v for k, v in self.run_figures().items() if isinstance(v, int | float | str)}

    def status_figures(self, head: dict | None) -> dict[str, Any]:
        """`pagefleet status --json` and the service's run status; `head`: the head that holds the run directory
        now (status.head_holding), or None. ETA and what slices wait for are shown only while a head runs."""
        return {
            "run_dir": self.run_dir,
            "head": head,
            "counts": dict(self.counts),
            "batches": self.batches,
            "prompts": self.prompts,
            "prompts_done": self.prompts_done,
            "rows_rejected": self.rows_rejected,
            "samples_done": self.samples_done,
            "output_tokens_done": self.output_tokens,
            "tokens_per_s": self.tokens_per_s,
            "eta_s": eta_s(self.prompts - self.prompts_done, self._session("prompts_per_s", None)) if head else None,
            "progress_updated_at": self._session("updated_at", None),
            "waiting": self._session("waiting", None) if head else None,
            "fault": None if head else self._session("fault", None),
            "mean_occupancy": self.mean_occupancy,
            "engine_time": dict(zip(("device_s", "host_s"), self.engine_time)) if self.engine_time else None,
            "prefix_cache": self.prefix_cache,
            "preemption": self.preemption,
            "transfers": self.transfers,
            "programs": self.programs,
            "failed": [{"batch_id": b.batch_id, "attempts": b.attempts, "error": b.error} for b in self.failed],
        }

    def format_run(self) -> str:
        """The summary `pagefleet run` prints at its end."""
        c = self.counts
        lines = [
            f"run directory    {self.run_dir}",
            f"batches          {c['done']:,} done, {c['failed']:,} failed, {self.batches_pending:,} pending of "
            f"{self.batches:,}",
            f"prompts          {self.prompts_done:,} of {self.prompts:,} done ({self.rows_rejected:,} rows rejected at "
            "planning)",
            f"samples          {self.samples_done:,} ({self.output_tokens:,} output tokens)",
        ]
        if self.session is not None:
            lines.append(f"this run         {self._session('session_batches'):,} batches, "
                         f"{self._session('session_output_tokens'):,} tokens in "
                         f"{self._session('session_elapsed_s', 0.0):,.1f} s = {self.tokens_per_s or 0.0:,.1f} tokens/s")
        lines += [f"{label:<17}{text}" for label, text in figure_lines(
            self.mean_occupancy, self.engine_time, self.prefix_cache, self.preemption, self.transfers, self.programs)]
        for b in self.failed:
            last = (b.error or "").strip().splitlines()[-1:] or ["?"]
            lines.append(f"failed {b.batch_id}: {last[0]}")
        return "\n".join(lines)


def _read_json(path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None
