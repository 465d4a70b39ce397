"""A whole run in a bucket: corpus, model and run directory as gs:// URLs on the Cloud Storage emulator."""

import pytest

from orchestrator.storage import storage
from orchestrator.config import load_run_config
from orchestrator.run.driver import Driver
from orchestrator.export.export import export
from orchestrator.state.manifest import read_manifest
from tests.gcs_emulator import upload

from ..conftest import run_args, write_run_corpus
from .test_driver import start_together


@pytest.mark.slow  # two runs of two slices each: minutes on a loaded 2-core machine
@pytest.mark.ray
def test_a_run_in_a_bucket_equals_the_same_run_on_local_paths(ray_local, run_model, tmp_path, gcs_bucket, monkeypatch):
    start_together(monkeypatch)
    corpus = write_run_corpus(tmp_path / "corpus.jsonl", 24)
    local = Driver(load_run_config(None, run_args(run_model, corpus, tmp_path / "run", "--sampling.temperature=0.8",
                                                  "--sampling.n=2")), show_progress=False).run()
    assert local.exit_code == 0

    run_dir = f"{gcs_bucket}/runs/r"
    cfg = load_run_config(None, run_args(upload(run_model, f"{gcs_bucket}/models/tiny"),
                                         upload(corpus, f"{gcs_bucket}/data/corpus.jsonl"), run_dir,
                                         "--sampling.temperature=0.8", "--sampling.n=2"))  # no model.cache_dir: ranged reads
    outcome = Driver(cfg, show_progress=False).run()
    assert outcome.exit_code == 0
    records = read_manifest(f"{run_dir}/batches.jsonl")
    assert len(records) > 2 and all(r.status == "done" and r.attempts == 1 for r in records)
    assert {r.slice for r in records} == {"slice-0", "slice-1"}
    assert storage.list_names(f"{run_dir}/outputs") == [f"{r.batch_id}.parquet" for r in records]
    events = storage.read_text(f"{run_dir}/events.log")
    assert events.count(" bytes read from the bucket)") == 2 and storage.exists(f"{run_dir}/progress.json")
    assert "could not write the throughput plot" not in events and storage.exists(f"{run_dir}/throughput.png")
    assert not storage.exists(f"{run_dir}/.lock")  # released

    export(tmp_path / "run", tmp_path / "local.jsonl")
    export(run_dir, f"{gcs_bucket}/exports/remote.jsonl")
    assert storage.read_bytes(f"{gcs_bucket}/exports/remote.jsonl") == (tmp_path / "local.jsonl").read_bytes()
