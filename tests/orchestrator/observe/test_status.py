import json

from orchestrator.state.lock import RunLock
from orchestrator.state.manifest import BatchRecord, write_manifest
from orchestrator.observe.status import format_status, status


def test_status_shows_what_a_running_heads_slices_wait_for(tmp_path):
    write_manifest(tmp_path / "batches.jsonl", [BatchRecord("b0", num_prompts=3)])
    waiting = "2 of 4 slices wait for resources the cluster does not have (2 started): a slice needs CPU 1"
    (tmp_path / "progress.json").write_text(json.dumps({"updated_at": 0, "tokens_per_s": 0.0, "waiting": waiting}))
    with RunLock(tmp_path):
        s = status(tmp_path)
        assert s["waiting"] == waiting
        assert f"waiting        {waiting}" in format_status(s)
    assert status(tmp_path)["waiting"] is None  # no head, nothing waits


def test_status_reads_the_totals_the_head_wrote_with_the_manifest_and_sees_any_edit(tmp_path, monkeypatch):
    """`status` of a manifest the head wrote reads batches.totals.json (counts, prompts, samples, output tokens,
    failed batches), not every line of a manifest that may hold a million; a manifest replaced or edited since (here
    "pending" -> "running" in place: the same size) is read line by line, as is one whose totals a crash left
    behind."""
    import orchestrator.observe.status as status_module
    from orchestrator.state.manifest import manifest_totals, read_manifest, totals_path

    path = tmp_path / "batches.jsonl"
    records = [BatchRecord("b0", "done", num_prompts=3, output="outputs/b0.parquet", num_samples=3,
                           num_output_tokens=40),
               BatchRecord("b1", "failed", num_prompts=2, attempts=3, error="boom"),
               BatchRecord("b2", num_prompts=4)]
    write_manifest(path, records)
    assert json.loads((tmp_path / "batches.totals.json").read_text())["totals"] == manifest_totals(records)
    assert totals_path(path) == str(tmp_path / "batches.totals.json")
    full = status(tmp_path)

    def no_lines(path):
        raise AssertionError("status read every line of the manifest")

    monkeypatch.setattr(status_module, "read_manifest", no_lines)
    fast = status(tmp_path)
    assert fast == full and fast["counts"] == {"pending": 1, "running": 0, "done": 1, "failed": 1}
    assert (fast["prompts"], fast["prompts_done"], fast["samples_done"], fast["output_tokens_done"]) == (9, 3, 3, 40)
    assert fast["failed"] == [{"batch_id": "b1", "attempts": 3, "error": "boom"}]
    monkeypatch.undo()

    with open(path, "r+b") as f:  # an edit in place that keeps the size
        data = f.read()
        f.seek(data.index(b'"pending"'))
        f.write(b'"running"')
    assert len(path.read_bytes()) == len(data)
    edited = status(tmp_path)
    assert edited["counts"] == {"pending": 0, "running": 1, "done": 1, "failed": 1}
    assert [r.status for r in read_manifest(path)] == ["done", "failed", "running"]
