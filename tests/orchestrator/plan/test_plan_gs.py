"""Planning from a bucket: corpus, model and tokenizer as gs:// URLs on the Cloud Storage emulator."""

import pyarrow.parquet as pq
import pytest

from orchestrator.plan.planner import plan
from tests.gcs_emulator import upload

from ..conftest import write_run_corpus
from .test_planner import config


@pytest.mark.slow  # about 90 s on a loaded 2-core machine (two plans on the cluster)
@pytest.mark.ray
def test_plan_from_gs_equals_plan_from_local_paths(tiny_model, tmp_path, gcs_bucket, ray_local):
    corpus = write_run_corpus(tmp_path / "c.jsonl", 60)
    local = plan(config(tiny_model, corpus, tmp_path / "local", f"--model.cache_dir={tmp_path / 'cache'}"))
    model_url = upload(tiny_model, f"{gcs_bucket}/models/tiny")
    corpus_url = upload(corpus, f"{gcs_bucket}/data/c.jsonl")  # read by the Ray workers from the bucket
    remote = plan(config(model_url, corpus_url, tmp_path / "remote", f"--model.cache_dir={tmp_path / 'cache'}"))
    assert remote.stats.num_batches == local.stats.num_batches > 1
    assert (tmp_path / "remote" / "batches.jsonl").read_text() == (tmp_path / "local" / "batches.jsonl").read_text()
    names = sorted(p.name for p in (tmp_path / "local" / "batches").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "remote" / "batches").iterdir())
    for name in names:
        assert pq.read_table(tmp_path / "remote" / "batches" / name).equals(
            pq.read_table(tmp_path / "local" / "batches" / name)), name
