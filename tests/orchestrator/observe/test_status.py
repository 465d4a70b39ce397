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
