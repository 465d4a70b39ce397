"""ensure_ray: join an existing cluster (RAY_ADDRESS or a `ray start` on this machine), else start a local Ray."""

import subprocess
import sys
from pathlib import Path

import pytest

from ..conftest import write_run_corpus

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.ray
def test_plan_joins_a_local_ray_start_cluster_despite_local_num_cpus(ray_head_env, tiny_model, tmp_path):
    env, start_options, _ = ray_head_env
    env = {**env, "RAY_AUTH_MODE": "disabled", "PYTHONPATH": str(ROOT)}
    start = subprocess.run(f"ray start --head {start_options}", shell=True, env=env, capture_output=True, text=True,
                           timeout=300)
    assert start.returncode == 0, start.stdout + start.stderr
    corpus = write_run_corpus(tmp_path / "c.jsonl", 8)
    # No RAY_ADDRESS: ray.init() finds the `ray start` cluster on its own, where num_cpus may not be given.
    plan = subprocess.run([sys.executable, "-m", "orchestrator", "plan", str(ROOT / "configs" / "demo.yaml"),
                           f"--model.path={tiny_model}", f"--corpus.path={corpus}", f"--run_dir={tmp_path / 'run'}",
                           "--cluster.local_num_cpus=2"], env=env, capture_output=True, text=True, timeout=600)
    assert plan.returncode == 0, plan.stderr[-3000:]
    assert "Connecting to existing Ray cluster" in plan.stderr
    assert "cluster.local_num_cpus=2 is ignored" in plan.stderr
    assert (tmp_path / "run" / "batches.jsonl").exists()


def test_existing_cluster_is_ray_address_else_the_recorded_one(monkeypatch, tmp_path):
    from orchestrator.slices.cluster import existing_cluster

    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert existing_cluster() is None
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "ray_current_cluster").write_text("127.0.0.1:6380")
    assert existing_cluster() == "127.0.0.1:6380"
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert existing_cluster() == "10.0.0.1:6379"
