"""RunState: what a restarted head makes of the run directory a crash left behind."""

from collections import Counter

import pyarrow as pa

from orchestrator.atomic import atomic_write_parquet
from orchestrator.manifest import BatchRecord, read_manifest, write_manifest
from orchestrator.results import SAMPLE_SCHEMA, BatchStats, with_stats
from orchestrator.run_state import RunState
from orchestrator.rundir import RunDir


def output(run_dir: RunDir, batch_id: str, rows: int) -> None:
    table = pa.Table.from_pydict({
        "prompt_id": [f"p{i}" for i in range(rows)], "generation_index": [0] * rows, "completion": ["x"] * rows,
        "token_ids": [[1, 2]] * rows, "logprobs": [None] * rows, "finish_reason": ["stop"] * rows,
        "num_prompt_tokens": [3] * rows, "batch_id": [batch_id] * rows, "row": list(range(rows))}, schema=SAMPLE_SCHEMA)
    atomic_write_parquet(run_dir.output_file(batch_id), with_stats(table, BatchStats(rows, 2 * rows, 1.5, 4, 0.5, 7)))


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
    output(run_dir, "b0", 2)
    output(run_dir, "b1", 2)
    output(run_dir, "b5", 2)
    (run_dir.outputs / ".b2.parquet.x.tmp").write_bytes(b"half")
    (tmp_path / ".batches.jsonl.y.tmp").write_text("half")

    state = RunState.recover(run_dir, samples_per_prompt=1)
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


def test_counts_follow_every_update(tmp_path):
    run_dir = RunDir(tmp_path)
    run_dir.outputs.mkdir()
    write_manifest(run_dir.manifest, [BatchRecord(f"b{i}", num_prompts=i + 1) for i in range(4)])
    state = RunState.recover(run_dir, samples_per_prompt=2)
    state.mark_running("b0", "slice-0")
    state.mark_done("b0", BatchStats(2, 5, 1.0, 3, 0.5, 2), "slice-0")
    state.mark_running("b1", "slice-1")
    state.mark_failed("b1", "boom", final=True)
    state.mark_running("b2", "slice-0")
    state.mark_failed("b2", "flaky", final=False)
    assert state.counts == Counter(r.status for r in state.records.values()) == Counter(
        {"done": 1, "failed": 1, "pending": 2})
    assert state.prompts_not_done == 2 + 3 + 4
    state.close()
    assert [r.status for r in read_manifest(run_dir.manifest)] == ["done", "failed", "pending", "pending"]
