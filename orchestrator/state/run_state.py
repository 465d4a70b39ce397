"""The head's copy of `batches.jsonl`: the only writer of the manifest and of events.log, and the only owner of
which batches are pending (in the order they are taken), which run where, and how often each was tried.

State changes happen in memory and reach disk through `flush`, which replaces the manifest
atomically. The durable truth of "done" is the output file: outputs/<id>.parquet is written
(atomically) before its batch is marked done, and on start an output whose batch is not yet marked
done is adopted rather than recomputed. So a crash between the two writes loses nothing, and
`flush` may batch several changes into one write (`flush_interval_s`) without weakening that.

A batch once done is held as its manifest line only (manifest_lines.py), and a batch never tried as its line until
it is taken (PendingLine): what the head holds grows with the batches still to do, not with the finished ones.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pyarrow.parquet as pq

from orchestrator.state.faults import crash_point
from orchestrator.state.manifest_lines import ManifestLines
from orchestrator.state.manifest import (BatchRecord, PendingLine, hold, manifest_totals, read_for_resume,
                                         write_manifest)
from orchestrator.state.manifest_check import canonical_output, reconcile
from orchestrator.state.output_plan import belongs
from orchestrator.state.results import BatchStats, stats_of
from orchestrator.state.rundir import RunDir
from orchestrator.storage import object_append, parquet_io, storage
from orchestrator.storage.atomic import remove_stale_temporaries


class RunState:
    def __init__(self, run_dir: RunDir, records: list[BatchRecord], flush_interval_s: float = 1.0,
                 manifest_generation: int | None = None, done: ManifestLines | None = None) -> None:
        self.run_dir = run_dir
        self.manifest_generation = manifest_generation
        """On an object store: the manifest's generation this head last read or wrote (its writes are conditioned
        on it, so a head that lost the run fails instead of overwriting); None locally."""
        self.done = done or ManifestLines()
        """The done batches, as their manifest lines and sums."""
        self.records: dict[str, BatchRecord | PendingLine] = {r.batch_id: r for r in records}
        """The batches not done, by id, a batch never tried perhaps still as its line (`record` builds it). (While
        `recover` checks them, also the done batches whose outputs it reads.)"""
        self.flush_interval_s = flush_interval_s
        self.counts: Counter[str] = Counter(r.status for r in records)
        """Batches per status, kept up to date by `update` (the head's loop reads it, never scans)."""
        self.counts["done"] += len(self.done)
        self.prompts_not_done = sum(r.num_prompts for r in records if r.status != "done")
        self._pending: dict[str, None] = {}  # pending batch ids in the order they are taken (an ordered set)
        self._running: dict[str, dict[str, None]] = {}  # slice -> the batches running there, in dispatch order
        self._attempts_before: dict[str, int] = {}
        """Attempts made before this head started (RunState.attempts), of every record; 0 for a PendingLine."""
        for r in records:
            self._index(r)
        self._dirty = False
        self._next_flush = 0.0
        self._events = object_append.open_append(run_dir.events)  # local file, or rewritten whole on gs://

    # -- start-up --------------------------------------------------------------------------------

    @classmethod
    def recover(cls, run_dir: RunDir, samples_per_prompt: int, plan: str, flush_interval_s: float = 1.0) -> RunState:
        """Load the manifest, check it against the plan (manifest_check.reconcile: a missing line comes back as
        pending, a duplicate is dropped, anything the plan cannot settle is refused), and repair what a crashed
        or stopped head left behind.

        `running` goes back to `pending`; an output written before the crash is adopted (its batch
        becomes `done`, nothing is recomputed) when it holds every sample and was computed for this
        plan (fingerprint `plan`) and this batch's prompts (output_plan.belongs), else it is removed and
        recomputed; a `done` batch whose output is missing, truncated or unreadable (its parquet footer is
        read, one small read a batch) is redone; `failed` batches become `pending` again, since a new run
        retries them.
        """
        removed = sum(remove_stale_temporaries(d) for d in (run_dir.root, run_dir.outputs))
        run_dir.outputs.mkdir(exist_ok=True)
        outputs = run_dir.outputs
        sizes = storage.list_sizes(outputs, ".parquet")  # one listing, not a request per batch

        def kind(fields: dict) -> str | None:
            """The common cases, a million times in a big run, held as lines and never built as records: "done", a
            done batch whose output has the size the head recorded; "line", a pending batch never tried that has no
            output to adopt. None: a record, checked below."""
            name = fields["batch_id"]
            size = sizes.get(f"{name}.parquet")
            if fields["status"] == "done":
                recorded = fields.get("output_bytes")
                return "done" if recorded is not None and size == recorded and fields.get(
                    "output") == canonical_output(name) else None
            return "line" if fields["status"] == "pending" and size is None and fields.get("attempts") == 0 else None

        records, done, generation, as_written = read_for_resume(run_dir.manifest, kind)
        # against the plan; ManifestMismatch if it cannot be
        records, repairs = reconcile(run_dir, records, as_written, done)
        state = cls(run_dir, records, flush_interval_s, manifest_generation=generation, done=done)
        if removed:
            state.event(f"removed {removed} unfinished temporary files left by a crash")
        for repair in repairs:
            state.event(f"batches.jsonl repaired from the plan: {repair}")
        state._dirty = bool(repairs)
        for r in list(state.records.values()):
            size = sizes.get(f"{r.batch_id}.parquet")
            if (r.status == "done" and size is not None and size == r.output_bytes) or (r.status == "pending"
                                                                                      and size is None):
                continue  # the common cases: nothing to do, no path built
            output = outputs / f"{r.batch_id}.parquet"
            if r.status == "done":
                if size is None:
                    state.update(r.batch_id, status="pending", output=None)
                    state.event(f"{r.batch_id} was done but {output.name} is missing; it will be recomputed")
                elif size != r.output_bytes if r.output_bytes is not None else \
                        _complete(output, r.samples(samples_per_prompt))[0] is None:
                    # Written atomically, so only something outside pagefleet cut or damaged it (a copy, a disk).
                    output.unlink()
                    state.update(r.batch_id, status="pending", output=None)
                    state.event(f"{r.batch_id} was done but {output} is corrupt or truncated; removed it, and the "
                                "batch will be recomputed")
                continue
            if size is not None and not run_dir.batch_file(r.batch_id).exists():
                state.event(f"{r.batch_id}: kept {output.name} but did not adopt it: its batch file is missing, so "
                            "nothing shows it holds this batch's prompts")
            elif size is not None:
                stats, why = _adoptable(output, samples_per_prompt, r.samples(samples_per_prompt), plan,
                                        run_dir.batch_file(r.batch_id))
                if stats is not None:
                    state.mark_done(r.batch_id, stats, slice=r.slice, adopted=True, output_bytes=size)
                    continue
                output.unlink()
                state.event(f"{r.batch_id}: removed {output.name}, which does not hold the batch's samples ({why})")
            if r.status == "running":
                state.update(r.batch_id, status="pending")
                state.event(f"{r.batch_id} was running when the previous head stopped; back to pending")
            elif r.status == "failed":
                state.update(r.batch_id, status="pending")
                state.event(f"{r.batch_id} failed in a previous run ({r.attempts} attempts); retrying")
        state._pending = {r.batch_id: None for r in state.records.values() if r.status == "pending"}  # plan order
        for r in [r for r in state.records.values() if r.status == "done"]:
            state._hold_as_done(r)
        state.flush(force=True)
        return state

    # -- changes ---------------------------------------------------------------------------------

    def record(self, batch_id: str) -> BatchRecord | None:
        """The record of a batch not done (None: done, or no such batch)."""
        r = self.records.get(batch_id)
        if type(r) is PendingLine:
            self.records[batch_id] = r = r.record()
            self._attempts_before[batch_id] = r.attempts
        return r

    def update(self, batch_id: str, **changes) -> BatchRecord:
        old = self.record(batch_id)
        record = dataclasses.replace(old, **changes)
        self.records[batch_id] = record
        if (record.status, record.slice) != (old.status, old.slice):
            self._unindex(old)
            self._index(record)
        if record.status != old.status:
            self.counts[old.status] -= 1
            self.counts[record.status] += 1
            self.prompts_not_done += old.num_prompts * ((record.status != "done") - (old.status != "done"))
            if record.status == "done":
                self._hold_as_done(record)
        self._dirty = True
        return record

    def _hold_as_done(self, record: BatchRecord) -> None:
        """From now on the done batch is its manifest line (it never changes again)."""
        del self.records[record.batch_id]
        self._attempts_before.pop(record.batch_id, None)
        hold(self.done, record)

    def mark_running(self, batch_id: str, slice: str) -> BatchRecord:
        r = self.record(batch_id)
        record = self.update(batch_id, status="running", slice=slice, attempts=r.attempts + 1,
                             started_at=time.time(), finished_at=None)
        self.event(f"{batch_id} running on {slice} (attempt {record.attempts})")
        return record

    def mark_done(self, batch_id: str, stats: BatchStats, slice: str | None, adopted: bool = False,
                  output_bytes: int | None = None) -> BatchRecord:
        """The batch is done: its output, of `output_bytes`, is written (the next resume checks it against them)."""
        record = self.update(batch_id, status="done", error=None, slice=slice, finished_at=time.time(),
                             output=f"outputs/{batch_id}.parquet", num_samples=stats.num_samples,
                             output_bytes=output_bytes,
                             num_output_tokens=stats.num_output_tokens, duration_s=round(stats.duration_s, 3),
                             occupancy=round(stats.occupancy, 4))
        how = "adopted the output written before the previous head stopped" if adopted else \
            f"{stats.num_samples} samples, {stats.num_output_tokens} tokens in {stats.duration_s:.1f} s"
        self.event(f"{batch_id} done: {how}")
        return record

    def mark_failed(self, batch_id: str, error: str, final: bool) -> BatchRecord:
        record = self.update(batch_id, status="failed" if final else "pending", error=error, finished_at=time.time())
        first_line = error.strip().splitlines()[-1] if error.strip() else "unknown error"
        self.event(f"{batch_id} attempt {record.attempts} failed ({first_line})"
                   + ("; no attempts left, marked failed" if final else "; will retry"))
        return record

    def replace_pending(self, records: list[BatchRecord]) -> None:
        """Drop every pending batch and add `records` (pending) in their place: a re-pack (see retune)."""
        for r in [r for r in self.records.values() if r.status == "pending"]:
            self._unindex(r)
            del self.records[r.batch_id]
            self.counts["pending"] -= 1
            self.prompts_not_done -= r.num_prompts
        for r in records:
            self.records[r.batch_id] = r
            self._attempts_before.pop(r.batch_id, None)
            self._index(r)
            self.counts[r.status] += 1
            self.prompts_not_done += r.num_prompts * (r.status != "done")
        self._dirty = True

    def event(self, text: str) -> None:
        self._events.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S%z')} {text}\n")
        self._events.flush()

    def flush(self, force: bool = False) -> None:
        """Replace batches.jsonl if anything changed.

        Unless forced, at most every flush_interval_s, and never more than a tenth of the time: a manifest
        of a million batches takes a while to write, and the head's loop must not spend itself on it.
        """
        if not self._dirty or (not force and time.monotonic() < self._next_flush):
            return
        start = time.monotonic()
        self.manifest_generation = write_manifest(self.run_dir.manifest, list(self.records.values()),
                                                  before_replace=lambda: crash_point("manifest_tmp"),
                                                  generation=self.manifest_generation, held=self.done)
        crash_point("manifest_written")
        self._dirty = False
        now = time.monotonic()
        self._next_flush = now + max(self.flush_interval_s, 9 * (now - start))

    def close(self) -> None:
        try:
            self.flush(force=True)
        finally:
            self._events.close()
            self.done.close()

    # -- views -----------------------------------------------------------------------------------

    def with_status(self, *statuses: str) -> list[BatchRecord | PendingLine]:
        """The batches not done with one of `statuses` (a done batch is no longer a record; a batch never tried may
        still be its PendingLine: read its batch_id, num_prompts, or `record`)."""
        return [r for r in self.records.values() if r.status in statuses]

    @property
    def num_batches(self) -> int:
        return len(self.records) + len(self.done)

    def batch_ids(self) -> Iterator[str]:
        """Every batch's id, the done ones' read back from their lines."""
        return itertools.chain(self.done.batch_ids(), list(self.records))

    def totals(self) -> dict:
        """The manifest's totals (manifest_totals), from the sums of the done batches and the other records."""
        return manifest_totals(self.records.values(), self.done)

    def attempts(self, batch_id: str) -> int:
        """Attempts at the batch by this head (the manifest's `attempts` counts every head's)."""
        return self.records[batch_id].attempts - self._attempts_before.get(batch_id, 0)

    def next_due(self, now: float, wait_s) -> str | None:
        """The first pending batch whose retry backoff (`wait_s(attempts)` after its last failure) is over."""
        for batch_id in self._pending:
            tried = self.attempts(batch_id)
            if not tried or self.records[batch_id].finished_at + wait_s(tried) <= now:
                return batch_id
        return None

    def running_on(self, slice: str) -> list[str]:
        """The batches running on `slice`, in the order they were sent there."""
        return list(self._running.get(slice, ()))

    def _index(self, r: BatchRecord) -> None:
        if type(r) is not PendingLine:
            self._attempts_before.setdefault(r.batch_id, r.attempts)
        if r.status == "pending":
            self._pending[r.batch_id] = None  # (re)joins at the end: a retried batch waits behind the others
        elif r.status == "running":
            self._running.setdefault(r.slice, {})[r.batch_id] = None

    def _unindex(self, r: BatchRecord) -> None:
        if r.status == "pending":
            del self._pending[r.batch_id]
        elif r.status == "running":
            del self._running[r.slice][r.batch_id]


def _complete(output: Path, expected_samples: int) -> tuple[pq.FileMetaData | None, BatchStats | None, str]:
    """(footer, stats, '') of an output file that holds `expected_samples` samples, or (None, None, why not).

    Reads the parquet footer only: one small read a batch, so a restart checks every done batch cheaply.
    """
    try:
        meta = parquet_io.read_parquet_metadata(output)
    except Exception as e:  # noqa: BLE001 - unreadable means not complete; it is recomputed
        return None, None, f"unreadable: {type(e).__name__}"
    stats = stats_of(meta.schema.to_arrow_schema())
    if stats is None or meta.num_rows != expected_samples:
        return None, None, f"{meta.num_rows} of {expected_samples} samples"
    return meta, stats, ""


def _adoptable(output: Path, n: int, num_samples: int, plan: str, batch_file: Path) -> tuple[BatchStats | None, str]:
    """(the stats of a complete output file of this plan's batch of `num_samples` samples, '') or (None, why it is
    not one)."""
    meta, stats, why = _complete(output, num_samples)
    if meta is None:
        return None, why
    try:
        why = belongs(output, meta, plan, batch_file, n)
    except Exception as e:  # noqa: BLE001 - unreadable means not adoptable; it is recomputed
        return None, f"unreadable: {type(e).__name__}"
    return (None, why) if why else (stats, "")
