"""The manifest checked against the plan: `batches.jsonl` is the resume point, but the plan is run.json (how many
prompts were accepted) and the batch files (batches/<id>.parquet, which prompts each batch holds).

What holds in every manifest the head writes, and is checked on recovery, by `status` and by `export`:

- every record is well formed (a string `batch_id`, a known `status`, a non-negative integer `num_prompts`, an
  `output` that is null or `outputs/<batch_id>.parquet`: a batch's samples are its own file, never another's);
- every batch appears exactly once;
- the records' prompts add up to run.json's accepted prompts (so no batch is missing and none is counted twice);
- where the checker reads batch files (recovery of a manifest the head did not write last, see below), each batch
  file holds the record's `num_prompts` rows.

A manifest whose sha256 is the one the head recorded when it last wrote it (batches.jsonl.sha256) is byte for byte
what the head wrote after these checks: recovery then skips reading a footer per batch file, which at a million
batches took longer than the run's first batch. Any edit, and a crash between the two writes, makes the digests
differ, and the manifest is checked line by line as before.

Recovery repairs what the plan determines: identical duplicate lines become one, a missing line whose batch file
is still there comes back as pending (when those batch files' prompts are exactly the missing ones), a wrong
`output` of a batch is set back to its own file. Anything else is refused in one line naming the record.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

from orchestrator.plan.continuation import batch_samples
from orchestrator.state.manifest_lines import ManifestLines
from orchestrator.state.manifest import STATUSES, BatchRecord, CorruptRunFile
from orchestrator.state.rundir import RunDir
from orchestrator.storage import parquet_io

_RESTORE = ("restore batches.jsonl from a backup, or plan afresh into a new run directory (--name=NAME) and move "
            "the outputs/ over: outputs that belong to the new plan are adopted")


class ManifestMismatch(CorruptRunFile):
    """batches.jsonl disagrees with the plan (run.json, batches/); the message names the record and the fix."""


def canonical_output(batch_id: str) -> str:
    return f"outputs/{batch_id}.parquet"


def accepted_prompts(run_dir: RunDir) -> int | None:
    """The plan's accepted prompts (run.json), or None where run.json does not say."""
    if not run_dir.run_json.exists():
        return None
    accepted = run_dir.read_run_json().get("plan", {}).get("accepted")
    return accepted if isinstance(accepted, int) else None


def check_record(run_dir: RunDir, r: BatchRecord) -> None:
    """Refuse a record that is not well formed (see module doc)."""
    if (isinstance(r.batch_id, str) and r.batch_id and "/" not in r.batch_id and r.status in STATUSES
            and type(r.num_prompts) is int and r.num_prompts >= 0
            and (r.output is None or r.output == canonical_output(r.batch_id))):
        return  # the common case, without building a message
    where = f"{run_dir.manifest}: batch {r.batch_id!r}"
    if not isinstance(r.batch_id, str) or not r.batch_id or "/" in r.batch_id:
        raise ManifestMismatch(f"{run_dir.manifest}: a record has batch_id {r.batch_id!r}, which names no batch; "
                               f"{_RESTORE}")
    if r.status not in STATUSES:
        raise ManifestMismatch(f"{where} has status {r.status!r} (one of {', '.join(STATUSES)}); {_RESTORE}")
    if not isinstance(r.num_prompts, int) or isinstance(r.num_prompts, bool) or r.num_prompts < 0:
        raise ManifestMismatch(f"{where} has num_prompts {r.num_prompts!r}, not a count; {_RESTORE}")
    if r.output is not None and r.output != canonical_output(r.batch_id):
        raise ManifestMismatch(f"{where} names {r.output!r} as its samples, not its own "
                               f"{canonical_output(r.batch_id)}; set its output back (or to null), or {_RESTORE}")


def check_manifest(run_dir: RunDir, records: list[BatchRecord]) -> None:
    """Refuse a manifest that disagrees with the plan, reading only run.json (for `status` and `export`)."""
    for r in records:
        check_record(run_dir, r)
    for batch_id, count in Counter(r.batch_id for r in records).items():
        if count > 1:
            raise ManifestMismatch(f"{run_dir.manifest}: batch {batch_id} appears {count} times (each planned batch "
                                   "appears once); `pagefleet run` keeps one of identical lines, or remove the extra "
                                   "lines yourself")
    _check_total(run_dir, records, accepted_prompts(run_dir))


def _prompts(records: list[BatchRecord], done: ManifestLines | None) -> int:
    """The manifest's prompts: its records' and those of the batches read as lines (`done`)."""
    return sum(r.num_prompts for r in records) + (done.prompts if done is not None else 0)


def _check_total(run_dir: RunDir, records: list[BatchRecord], accepted: int | None,
                 done: ManifestLines | None = None) -> None:
    total = _prompts(records, done)
    if accepted is not None and total != accepted:
        missing = ("a batch's line is missing; `pagefleet run` restores missing lines from batches/ when their prompts "
                   "are exactly the missing ones" if total < accepted else "a record's num_prompts is wrong")
        raise ManifestMismatch(f"{run_dir.manifest} holds {total:,} prompts but the plan (run.json) accepted "
                               f"{accepted:,}: {missing}; otherwise {_RESTORE}")


def reconcile(run_dir: RunDir, records: list[BatchRecord], as_written: bool = False, done: ManifestLines | None = None
              ) -> tuple[list[BatchRecord], list[str]]:
    """(the records repaired from the plan, what was repaired) for recovery; ManifestMismatch when the plan does
    not determine the repair (see module doc). `as_written`: the manifest is the one the head last wrote (its
    digest matches), so its batch files' row counts are not read again. `done`: the manifest's done batches that
    were read as lines, not records (read_for_resume; only from a manifest as the head wrote it)."""
    repairs: list[str] = []
    for r in records:
        if r.output is not None and r.output != canonical_output(r.batch_id) and isinstance(r.batch_id, str):
            repairs.append(f"{r.batch_id}: output {r.output!r} set back to its own {canonical_output(r.batch_id)}")
            records = [dataclasses.replace(x, output=canonical_output(x.batch_id)) if x is r else x for x in records]
    for r in records:
        check_record(run_dir, r)
    unique: dict[str, BatchRecord] = {}
    for r in records:
        if r.batch_id in unique:
            if unique[r.batch_id] != r:
                raise ManifestMismatch(f"{run_dir.manifest}: batch {r.batch_id} appears more than once with different "
                                       f"contents; remove the wrong line, or {_RESTORE}")
            repairs.append(f"{r.batch_id}: dropped a duplicate line")
            continue
        unique[r.batch_id] = r
    records = list(unique.values())
    for r in [] if as_written else records:
        path = run_dir.batch_file(r.batch_id)
        if (rows := _rows(path)) is not None and rows != r.num_prompts:
            raise ManifestMismatch(f"{run_dir.manifest}: batch {r.batch_id} has num_prompts {r.num_prompts} but its "
                                   f"batch file {path.name} holds {rows} prompts; set num_prompts to {rows}, or "
                                   f"{_RESTORE}")
    accepted = accepted_prompts(run_dir)
    total = _prompts(records, done)
    if accepted is not None and total < accepted and run_dir.batches.is_dir():
        known = set(unique) | set(done.batch_ids() if done is not None else ())
        orphans = sorted(p.stem for p in run_dir.batches.glob("*.parquet") if p.stem not in known)
        rows = {b: _rows(run_dir.batch_file(b)) for b in orphans}
        if None not in rows.values() and sum(rows.values()) == accepted - total:
            for b in orphans:
                table = parquet_io.read_parquet(run_dir.batch_file(b))
                tokens = sum(len(t) for t in table.column("token_ids").to_pylist())
                scored = (table.column("continuations").to_pylist() if "continuations" in table.column_names
                          else [])  # a scored row gives one sample per continuation
                records.append(BatchRecord(b, num_prompts=rows[b], num_prompt_tokens=tokens,
                                           expected_samples=batch_samples(len(c or ()) for c in scored)))
                repairs.append(f"{b}: its line was missing from batches.jsonl; restored from {b}.parquet as pending")
    _check_total(run_dir, records, accepted, done)
    return records, repairs


def _rows(batch_file) -> int | None:
    """The batch file's row count from its footer; None when it is missing or unreadable (the slice that reads it
    reports that, as the batch's error)."""
    try:
        return parquet_io.read_parquet_metadata(batch_file).num_rows if batch_file.exists() else None
    except Exception:  # noqa: BLE001 - unreadable: not this check's to report
        return None
