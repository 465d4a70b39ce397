"""RunState: what a restarted head makes of the run directory a crash left behind."""

import dataclasses
from collections import Counter

import pyarrow as pa
import pytest

from orchestrator.storage.atomic import atomic_write_parquet
from orchestrator.state.manifest import BatchRecord, read_manifest, write_manifest
from orchestrator.state.output_plan import stamp
from orchestrator.state.results import SAMPLE_SCHEMA, BatchStats, with_stats
from orchestrator.state.run_state import RunState
from orchestrator.state.rundir import RunDir


PLAN = "plan-fingerprint"


def batch_file(run_dir: RunDir, batch_id: str, prompts: int) -> None:
    run_dir.batches.mkdir(exist_ok=True)
    atomic_write_parquet(run_dir.batch_file(batch_id), pa.table({
        "prompt_id": [f"p{i}" for i in range(prompts)], "row": list(range(prompts)), "token_ids": [[1]] * prompts}))


def output(run_dir: RunDir, batch_id: str, rows: int, plan: str | None = PLAN, ids: list[str] | None = None) -> None:
    """An output of `rows` samples (prompts p0, p1, ... once each), stamped with `plan` (None: an older output)."""
    ids = ids or [f"p{i}" for i in range(rows)]
    given = {
        "prompt_id": ids, "generation_index": [0] * rows, "completion": ["x"] * rows,
        "token_ids": [[1, 2]] * rows, "logprobs": [None] * rows, "finish_reason": ["stop"] * rows,
        "num_prompt_tokens": [3] * rows, "batch_id": [batch_id] * rows, "passthrough": [None] * rows,
        "row": list(range(rows))}
    table = pa.Table.from_pydict({f.name: given.get(f.name, [None] * rows) for f in SAMPLE_SCHEMA},  # score fields null
                                 schema=SAMPLE_SCHEMA)
    table = with_stats(table, BatchStats(rows, 2 * rows, 1.5, 4, 0.5, 7))
    atomic_write_parquet(run_dir.output_file(batch_id), table if plan is None else stamp(table, plan, ids))


def test_recover_repairs_what_a_crash_left(tmp_path):
    run_dir = RunDir(tmp_path)
    run_dir.outputs.mkdir()
    records = [
        BatchRecord("b0", "done", num_prompts=2, attempts=1, output="outputs/b0.parquet"),
        BatchRecord("b1", "running", num_prompts=2, attempts=1),  # its output was written, not yet marked
        BatchRecord("b2", "running", num_prompts=2, attempts=2),  # died mid-batch
        BatchRecord("b3", "failed", num_prompts=2, attempts=3, error="boom"),
        BatchRecord("b4", "done", num_prompts=2, attempts=1, output="outputs/b4.parquet"),  # output lost
        BatchRecord("b5", "pending", num_prompts=3),  # a wrong-sized output: not this batch's samples
    ]
    write_manifest(run_dir.manifest, records)
    for r in records:
        batch_file(run_dir, r.batch_id, r.num_prompts)
    output(run_dir, "b0", 2)
    output(run_dir, "b1", 2)
    output(run_dir, "b5", 2)
    (run_dir.outputs / ".b2.parquet.x.tmp").write_bytes(b"half")
    (tmp_path / ".batches.jsonl.y.tmp").write_text("half")

    state = RunState.recover(run_dir, samples_per_prompt=1, plan=PLAN)
    state.close()
    after = {r.batch_id: r for r in read_manifest(run_dir.manifest)}
    assert {k: r.status for k, r in after.items()} == {
        "b0": "done", "b1": "done", "b2": "pending", "b3": "pending", "b4": "pending", "b5": "pending"}
    assert after["b1"].num_output_tokens == 4 and after["b1"].output == "outputs/b1.parquet"  # stats from the file
    assert after["b2"].attempts == 2 and after["b3"].attempts == 3  # attempts are history, kept
    assert not (run_dir.outputs / "b5.parquet").exists()
    assert not list(tmp_path.glob(".*.tmp")) and not list(run_dir.outputs.glob(".*.tmp"))
    assert state.counts == Counter(r.status for r in after.values())
    assert state.prompts_not_done == 2 + 2 + 2 + 3
    events = run_dir.events.read_text()
    assert "b1 done: adopted" in events and "b4 was done but b4.parquet is missing" in events


def test_only_outputs_of_this_plan_and_batch_are_adopted(tmp_path):
    run_dir = RunDir(tmp_path)
    run_dir.outputs.mkdir()
    names = ["this-plan", "other-plan", "other-ids", "older-same-ids", "older-other-ids", "no-batch-file"]
    write_manifest(run_dir.manifest, [BatchRecord(b, "running", num_prompts=2, attempts=1) for b in names])
    for b in names[:-1]:
        batch_file(run_dir, b, 2)
    output(run_dir, "this-plan", 2)
    output(run_dir, "other-plan", 2, plan="another-plan")  # run.json removed, then another seed or corpus
    output(run_dir, "other-ids", 2, ids=["q0", "q1"])
    output(run_dir, "older-same-ids", 2, plan=None)  # written before outputs carried their plan: checked by content
    output(run_dir, "older-other-ids", 2, plan=None, ids=["p1", "p0"])
    output(run_dir, "no-batch-file", 2)

    RunState.recover(run_dir, samples_per_prompt=1, plan=PLAN).close()
    after = {r.batch_id: r.status for r in read_manifest(run_dir.manifest)}
    assert after == {"this-plan": "done", "other-plan": "pending", "other-ids": "pending", "older-same-ids": "done",
                     "older-other-ids": "pending", "no-batch-file": "pending"}
    assert {p.stem for p in run_dir.outputs.glob("*.parquet")} == {"this-plan", "older-same-ids", "no-batch-file"}
    events = run_dir.events.read_text()
    assert "computed for another plan" in events and "prompt ids are not this batch's" in events
    assert "not this batch's prompts" in events and "its batch file is missing" in events


def test_counts_follow_every_update(tmp_path):
    run_dir = RunDir(tmp_path)
    run_dir.outputs.mkdir()
    write_manifest(run_dir.manifest, [BatchRecord(f"b{i}", num_prompts=i + 1) for i in range(4)])
    state = RunState.recover(run_dir, samples_per_prompt=2, plan=PLAN)
    state.mark_running("b0", "slice-0")
    state.mark_done("b0", BatchStats(2, 5, 1.0, 3, 0.5, 2), "slice-0")
    state.mark_running("b1", "slice-1")
    state.mark_failed("b1", "boom", final=True)
    state.mark_running("b2", "slice-0")
    state.mark_failed("b2", "flaky", final=False)
    assert "b0" not in state.records and len(state.done) == 1  # a done batch is held as its manifest line
    assert state.counts == Counter(r.status for r in state.records.values()) + Counter(done=1) == Counter(
        {"done": 1, "failed": 1, "pending": 2})
    assert state.prompts_not_done == 2 + 3 + 4
    state.close()
    assert [r.status for r in read_manifest(run_dir.manifest)] == ["done", "failed", "pending", "pending"]


def test_run_state_alone_knows_what_is_pending_running_and_tried(tmp_path):
    """The head's queues derive from RunState: pending batches in the order they are taken (a retried batch
    behind the others, and only once its backoff is over), the batches running on each slice, and the attempts
    this head made (the manifest's count includes a previous head's)."""
    run_dir = RunDir(tmp_path)
    write_manifest(run_dir.manifest, [BatchRecord("b0", "failed", num_prompts=1, attempts=3, error="old"),
                                      BatchRecord("b1", num_prompts=1), BatchRecord("b2", num_prompts=1)])
    state = RunState.recover(run_dir, 1, PLAN)
    wait = lambda attempts: 10.0 * attempts  # noqa: E731 - seconds after the attempts-th failure
    assert state.next_due(0.0, wait) == "b0" and state.attempts("b0") == 0  # tried by a previous head only
    state.mark_running("b0", "slice-0")
    state.mark_running("b1", "slice-1")
    state.mark_running("b2", "slice-0")
    assert state.running_on("slice-0") == ["b0", "b2"] and state.running_on("slice-1") == ["b1"]
    assert state.next_due(0.0, wait) is None and state.attempts("b0") == 1 and state.records["b0"].attempts == 4
    failed_at = state.mark_failed("b0", "boom", final=False).finished_at
    assert state.running_on("slice-0") == ["b2"] and state.counts["pending"] == 1
    assert state.next_due(failed_at + 9.9, wait) is None and state.next_due(failed_at + 10.0, wait) == "b0"
    state.mark_failed("b1", "boom", final=False)
    assert [state.next_due(failed_at + 1e6, wait)] == ["b0"]  # b1 waits behind b0, which failed first
    state.mark_done("b2", BatchStats(1, 1, 0.1, 1, 1.0, 1), "slice-0")
    assert state.running_on("slice-0") == [] and state.counts["running"] == 0


def test_a_resume_trusts_what_the_head_wrote_and_checks_what_it_did_not(tmp_path, monkeypatch):
    """At a million batches a resume read a footer per batch file and per done output (20 minutes before the first
    batch). A manifest byte for byte as the head wrote it (its sha256 beside it) needs no batch file read, and a
    done output is checked against the size the head recorded, from one listing; an edited manifest, or a record
    without a size, is checked file by file as before."""
    from orchestrator.storage import parquet_io

    run_dir = RunDir(tmp_path)
    run_dir.outputs.mkdir()
    for b in ("b0", "b1", "b2"):
        batch_file(run_dir, b, 2)
    output(run_dir, "b0", 2)
    output(run_dir, "b1", 2)
    sizes = {b: run_dir.output_file(b).stat().st_size for b in ("b0", "b1")}
    write_manifest(run_dir.manifest, [
        BatchRecord("b0", "done", num_prompts=2, output="outputs/b0.parquet", output_bytes=sizes["b0"]),
        BatchRecord("b1", "done", num_prompts=2, output="outputs/b1.parquet", output_bytes=sizes["b1"]),
        BatchRecord("b2", num_prompts=2)])
    (tmp_path / "run.json").write_text('{"plan": {"accepted": 6}, "fingerprints": {}, "sample_affecting": {}}')
    reads = []
    real = parquet_io.read_parquet_metadata
    monkeypatch.setattr(parquet_io, "read_parquet_metadata", lambda path: reads.append(path) or real(path))

    RunState.recover(run_dir, 1, PLAN).close()
    assert reads == []  # no batch file's footer, no done output's: the listing's sizes match the records

    # An output replaced by another file (here b1's samples, a valid parquet file of the same rows) is recomputed.
    run_dir.output_file("b0").write_bytes(run_dir.output_file("b1").read_bytes() + b"\0")
    state = RunState.recover(run_dir, 1, PLAN)
    assert state.records["b0"].status == "pending" and not run_dir.output_file("b0").exists()
    assert "b1" not in state.records and len(state.done) == 1 and reads == []  # b1 done, held as its line
    state.close()

    # Edited by hand: the digest no longer matches, every batch file is read and the edit is found.
    text = run_dir.manifest.read_text()
    run_dir.manifest.write_text(text.replace('"batch_id": "b2", "status": "pending", "num_prompts": 2',
                                             '"batch_id": "b2", "status": "pending", "num_prompts": 3'))
    (tmp_path / "run.json").write_text('{"plan": {"accepted": 7}, "fingerprints": {}, "sample_affecting": {}}')
    try:
        RunState.recover(run_dir, 1, PLAN)
    except ValueError as e:
        assert "b2 has num_prompts 3 but its batch file b2.parquet holds 2 prompts" in str(e)
    else:
        raise AssertionError("an edited num_prompts was not found")
    assert reads


@pytest.mark.parametrize("where", ["local", "gcs"])
def test_a_resumed_head_holds_the_batches_still_to_do_not_the_done_ones(tmp_path, where, request):
    """A million done batches took 650 MB and seconds of records on every resume: a done batch is held as its manifest
    line and its sums (ManifestLines), a pending batch never tried as its line until it is taken (PendingLine); every
    manifest the head writes still holds each batch once, with the same fields, and the totals beside it agree."""
    from orchestrator.state.manifest import PendingLine, manifest_totals, read_totals
    from orchestrator.storage import location, storage

    root = tmp_path if where == "local" else location.location(f"{request.getfixturevalue('gcs_bucket')}/run")
    run_dir = RunDir(root)
    run_dir.outputs.mkdir(exist_ok=True)
    for b in ("d0", "d1", "d2", "p0", "p1", "f0"):
        batch_file(run_dir, b, 2)
    for b in ("d0", "d1", "d2"):
        output(run_dir, b, 2)
    size = {b: storage.file_size(run_dir.output_file(b)) for b in ("d0", "d1", "d2")}
    planned = [BatchRecord(b, "done", num_prompts=2, attempts=1, output=f"outputs/{b}.parquet", num_samples=2,
                           num_output_tokens=4 + i, output_bytes=size[b], slice="slice-0", finished_at=1.5)
               for i, b in enumerate(("d0", "d1", "d2"))]
    planned += [BatchRecord("p0", num_prompts=2, num_prompt_tokens=9, num_pages=3),
                BatchRecord("p1", num_prompts=2, attempts=2, error="flaky"),  # tried before: a record
                BatchRecord("f0", "failed", num_prompts=2, attempts=3, error="boom")]
    write_manifest(run_dir.manifest, planned)
    lines = run_dir.manifest.read_bytes().splitlines()
    run_dir.write_run_json({"plan": {"accepted": 12}, "fingerprints": {}, "sample_affecting": {}})

    state = RunState.recover(run_dir, 1, PLAN)
    assert set(state.records) == {"p0", "p1", "f0"} and len(state.done) == 3 and state.num_batches == 6
    assert type(state.records["p0"]) is PendingLine and state.counts == Counter(done=3, pending=3)
    assert state.prompts_not_done == 6 and state.attempts("p0") == 0 and state.attempts("p1") == 0
    assert state.next_due(0.0, lambda tried: 0.0) == "p0"
    assert state.mark_running("p0", "slice-1").attempts == 1 and state.attempts("p0") == 1  # built when taken
    output(run_dir, "p0", 2)
    state.mark_done("p0", BatchStats(2, 7, 1.0, 3, 0.5, 2), "slice-1",
                    output_bytes=storage.file_size(run_dir.output_file("p0")))
    assert "p0" not in state.records and len(state.done) == 4 and state.counts["done"] == 4
    assert state.totals() == {"counts": {"pending": 2, "running": 0, "done": 4, "failed": 0}, "prompts": 12,
                              "prompts_done": 8, "samples_done": 8, "output_tokens": 4 + 5 + 6 + 7, "failed": []}
    assert sorted(state.batch_ids()) == ["d0", "d1", "d2", "f0", "p0", "p1"]
    state.close()

    after = {r.batch_id: r for r in read_manifest(run_dir.manifest)}
    assert len(after) == 6 and len(run_dir.manifest.read_text().splitlines()) == 6
    assert [after[b] for b in ("d0", "d1", "d2")] == planned[:3]  # done lines copied as they were
    assert after["p0"].status == "done" and after["p0"].output_bytes > 0 and after["p0"].num_pages == 3
    assert after["p1"] == dataclasses.replace(planned[4]) and after["f0"].status == "pending"  # retried by a new run
    assert read_totals(run_dir.manifest) == manifest_totals(after.values())
    assert run_dir.manifest.read_bytes().splitlines()[:3] == lines[:3]  # byte for byte

    again = RunState.recover(run_dir, 1, PLAN)  # the manifest is as the head wrote it: the same split again
    assert set(again.records) == {"p1", "f0"} and len(again.done) == 4
    again.close()
