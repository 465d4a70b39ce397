import json
import os
import pickle
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orchestrator.observe.tracking import SAMPLE_COLUMNS, NoopTracker, TrackerConfig, WandbTracker, make_tracker

BATCH_KEYS = ("batch_id", "num_prompts", "num_samples", "num_prompt_tokens", "num_output_tokens", "duration_s",
              "tokens_per_s", "pages", "occupancy", "attempts", "slice")
SUMMARY = {"tokens_per_s": 1234.5, "num_samples": 500, "num_batches": 3, "status": "done"}
RUN_CONFIG = {"name": "demo", "sampling": {"n": 2, "temperature": 0.0}, "engine": {"max_seqs": 16}}


def batch_row(i: int) -> dict:
    return {"batch_id": i, "num_prompts": 10 + i, "num_samples": 20 + i, "num_prompt_tokens": 300, "num_output_tokens": 640,
            "duration_s": 2.0, "tokens_per_s": 320.0 + i, "pages": 96, "occupancy": 0.75, "attempts": 1,
            "slice": f"slice-{i % 2}"}


def sample_record(i: int) -> dict:
    return {"prompt_id": f"p{i:03d}", "generation_index": i % 2, "completion": f"text {i}", "token_ids": [1] * (i % 7),
            "logprobs": None, "finish_reason": "length", "num_prompt_tokens": 5, "batch_id": i // 200}


def read_wandb_log(path: Path) -> list:
    """Records of a run's `run-<id>.wandb` transaction log (a LevelDB-style log of protobuf Records).

    wandb 0.31 offline keeps the config, history and summary only here (no config.yaml or
    wandb-summary.json under files/ until `wandb sync`); 32 KiB blocks, a 7-byte file header
    (":W&B", magic, version) and a 7-byte header per chunk (crc32, length, type: 1 full, 2 first,
    3 middle, 4 last).
    """
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    if len(data) < 7:
        return []
    assert data[:4] == b":W&B"
    records, pending, pos, block = [], b"", 7, 32768
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # block trailer padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        if pos + 7 + length > len(data):  # still being written
            break
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def fold(items) -> dict:
    """Summary updates or history items -> {dotted key: value}."""
    return {item.key or ".".join(item.nested_key): json.loads(item.value_json) for item in items}


@pytest.fixture(scope="module")
def offline_run(tmp_path_factory):
    """One offline run shared by the assertions below: 3 batches, 500 samples (50 kept), finished."""
    run_dir = tmp_path_factory.mktemp("run")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WANDB_MODE", "offline")
        mp.setenv("WANDB_SILENT", "true")
        tracker = make_tracker(TrackerConfig(mode="offline", samples_table_rows=50), run_dir, "demo", RUN_CONFIG)
        assert isinstance(tracker, WandbTracker)
        for i in range(3):
            tracker.log_batch(batch_row(i))
        for start in range(0, 500, 100):
            tracker.add_samples([sample_record(i) for i in range(start, start + 100)])
        tracker.finish(SUMMARY)
    (run,) = (run_dir / "wandb").glob("offline-run-*")
    # wandb-core may still be flushing the transaction log when finish() returns: wait for its exit record.
    deadline = time.monotonic() + 30
    while True:
        logs = list(run.glob("run-*.wandb"))
        records = read_wandb_log(logs[0]) if logs else []
        if (records and records[-1].WhichOneof("record_type") == "exit") or time.monotonic() > deadline:
            return run, records
        time.sleep(0.05)


def read_table(run: Path, name: str) -> dict:
    (path,) = (run / "files" / "media" / "table").glob(f"{name}_*.table.json")
    return json.loads(path.read_text())


def test_offline_run_writes_the_batches_table(offline_run):
    run, _ = offline_run
    table = read_table(run, "batches")
    assert table["columns"] == list(BATCH_KEYS)
    assert table["data"] == [[batch_row(i)[k] for k in BATCH_KEYS] for i in range(3)]


def test_offline_run_writes_a_bounded_samples_table(offline_run):
    run, _ = offline_run
    table = read_table(run, "samples")
    assert table["columns"] == list(SAMPLE_COLUMNS)
    assert len(table["data"]) == 50
    assert [row[0] for row in table["data"]] == [f"p{i:03d}" for i in range(50)]  # the first ones, in order
    assert table["data"][3] == ["p003", 1, 0, "text 3", "length", 5, None, None, 3]  # not scored: no scores


def test_offline_run_records_config_history_and_summary(offline_run):
    _, records = offline_run
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (run.project, run.display_name, run.run_group) == ("pagefleet", "demo", "demo")  # group = run name
    config = fold(run.config.update)
    assert config["sampling"] == RUN_CONFIG["sampling"] and config["engine"] == RUN_CONFIG["engine"]
    history = [fold(r.history.item) for r in records if r.WhichOneof("record_type") == "history"]
    assert [h["tokens_per_s"] for h in history if "tokens_per_s" in h] == [320.0, 321.0, 322.0]  # the charts
    summary: dict = {}
    for r in records:
        if r.WhichOneof("record_type") == "summary":
            summary.update(fold(r.summary.update))
            for item in r.summary.remove:
                summary.pop(item.key or ".".join(item.nested_key), None)
    for key, value in SUMMARY.items():
        assert summary[key] == value
    # Run totals only: not the last batch's values, which W&B copies from the history unless removed.
    leaked = {k for k in summary if not k.startswith("_")} - set(SUMMARY) - {"samples", "batches"}
    assert not {k.split(".")[0] for k in leaked} - {"samples", "batches"}, sorted(leaked)
    assert records[-1].WhichOneof("record_type") == "exit"  # the run was finished


def test_samples_table_is_written_when_full_not_at_the_end(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    tracker = make_tracker(TrackerConfig(mode="offline", samples_table_rows=5), tmp_path, "demo", RUN_CONFIG)
    tracker.log_batch(batch_row(0))
    tracker.add_samples([sample_record(i) for i in range(3)])
    tracker.add_samples([sample_record(i) for i in range(3, 9)])  # fills the table: a long run shows it now
    (run,) = (tmp_path / "wandb").glob("offline-run-*")
    tables = run / "files" / "media" / "table"
    deadline = time.monotonic() + 30
    while not list(tables.glob("samples_*.table.json")) and time.monotonic() < deadline:
        time.sleep(0.05)
    table = read_table(run, "samples")  # before finish(): what a crash of the head would leave
    assert [row[0] for row in table["data"]] == [f"p{i:03d}" for i in range(5)]
    tracker.add_samples([sample_record(9)])
    tracker.finish(SUMMARY)
    assert read_table(run, "samples") == table  # logged once
    assert len(read_table(run, "batches")["data"]) == 1


def test_disabled_and_noop_write_nothing(tmp_path):
    for config in (TrackerConfig(mode="disabled"), TrackerConfig(type="noop", mode="offline")):
        tracker = make_tracker(config, tmp_path / "run", "demo", RUN_CONFIG)
        assert isinstance(tracker, NoopTracker)
        tracker.log_batch(batch_row(0))
        tracker.add_samples([sample_record(0)])
        tracker.finish(SUMMARY)
    tracker = WandbTracker(TrackerConfig(mode="disabled"), tmp_path / "run", "demo", RUN_CONFIG)  # W&B's own disabled
    tracker.log_batch(batch_row(0))
    tracker.add_samples([sample_record(0)])
    tracker.finish(SUMMARY)
    assert list(tmp_path.iterdir()) == []


def trackers(tmp_path):
    return [NoopTracker(), WandbTracker(TrackerConfig(mode="disabled"), tmp_path, "demo", {})]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_tracker_refuses_use_from_another_process(tmp_path):
    for tracker in trackers(tmp_path):
        pid = os.fork()
        if pid == 0:  # child: exit 0 only if the tracker refused, naming the head
            try:
                tracker.log_batch(batch_row(0))
            except RuntimeError as e:
                os._exit(0 if "belongs to the head process" in str(e) else 2)
            os._exit(1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, type(tracker).__name__
        tracker.finish(SUMMARY)  # still fine in the head


def test_a_tracker_refuses_pickling(tmp_path):
    for tracker in trackers(tmp_path):
        with pytest.raises(TypeError, match="belongs to the head process; slices return stats as data"):
            pickle.dumps(tracker)


def test_config_validation_names_the_key():
    with pytest.raises(ValueError, match="tracker.samples_table_rows"):
        TrackerConfig(samples_table_rows=-1)
    with pytest.raises(ValueError, match="tracker.batches_table_rows"):
        TrackerConfig(batches_table_rows=20_000)
    with pytest.raises(ValueError, match="tracker.mode"):
        TrackerConfig(mode="online-ish")  # type: ignore[arg-type]
    assert TrackerConfig(samples_table_rows=0).samples_table_rows == 0


def test_importing_tracking_does_not_import_wandb():
    code = "import sys, orchestrator.observe.tracking; sys.exit('wandb' in sys.modules)"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])}
    assert subprocess.run([sys.executable, "-c", code], env=env).returncode == 0
