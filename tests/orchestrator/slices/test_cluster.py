"""ensure_ray: join an existing cluster (RAY_ADDRESS or a `ray start` on this machine), else start a local Ray."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ..conftest import free_ports, run_args, write_run_corpus

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
                           "--cluster.local_num_cpus=2", "--corpus.in_process_bytes=0"],  # planned on the cluster
                          env=env, capture_output=True, text=True, timeout=600)
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


def test_a_recorded_cluster_that_is_gone_is_one_line_and_exit_2(run_model, tmp_path):
    """A `ray start` cluster stopped without `ray stop` leaves ray_current_cluster behind; ray.init would retry
    its GCS for minutes. `pagefleet run` says so in one line and exits 2 instead."""
    (gcs,) = free_ports(1)  # nothing listens there
    temp = tmp_path / "raytmp"
    (temp / "ray").mkdir(parents=True)
    (temp / "ray" / "ray_current_cluster").write_text(f"127.0.0.1:{gcs}")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_TMPDIR=str(temp), PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    corpus = write_run_corpus(tmp_path / "c.jsonl", 4)
    started = time.monotonic()
    run = subprocess.run([sys.executable, "-m", "orchestrator", "run", str(ROOT / "configs" / "demo.yaml"),
                          *run_args(run_model, corpus, tmp_path / "run")],
                         env=env, capture_output=True, text=True, timeout=120)
    assert time.monotonic() - started < 30
    assert run.returncode == 2, run.stderr[-3000:]
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1, run.stderr[-3000:]
    assert lines[0].startswith(f"pagefleet run: the Ray cluster recorded by a `ray start` on this machine (127.0.0.1:{gcs}")
    assert str(temp / "ray" / "ray_current_cluster") in lines[0] and "RAY_ADDRESS" in lines[0]


def test_ray_address_local_starts_a_local_ray_whatever_was_recorded(monkeypatch, tmp_path):
    from orchestrator.slices.cluster import existing_cluster

    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "ray_current_cluster").write_text("127.0.0.1:6380")
    monkeypatch.setenv("RAY_ADDRESS", "local")
    assert existing_cluster() is None


def test_ray_init_does_not_take_over_a_sigterm_handler_set_before_it(monkeypatch):
    """ray.init installs its own SIGTERM handler (exit 15, and Ray's C-level stack dump): the head's clean stop,
    set before planning starts Ray, is put back (`ray job stop` during planning: one line, exit 130)."""
    import signal

    import ray

    from orchestrator.slices.cluster import ClusterConfig, ensure_ray

    def fake_init(**kwargs):  # what ray.init does to the handler
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(signum))

    def ours(signum, frame):
        raise KeyboardInterrupt

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", fake_init)
    monkeypatch.setenv("RAY_ADDRESS", "local")
    previous = signal.signal(signal.SIGTERM, ours)
    try:
        ensure_ray(ClusterConfig())
        assert signal.getsignal(signal.SIGTERM) is ours
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_jax_fork_warnings_from_starting_ray_are_not_shown(monkeypatch, recwarn):
    """Ray starts its processes by fork and exec, which JAX (loaded by pagefleet.generate) warns about as if
    the fork could deadlock its threads; `pagefleet.generate` then `pagefleet.run` printed that twice."""
    import warnings

    import ray

    from orchestrator.slices.cluster import ClusterConfig, ensure_ray

    def fake_init(**kwargs):
        warnings.warn("os.fork() was called. os.fork() is incompatible with multithreaded code, and JAX is "
                      "multithreaded, so this will likely lead to a deadlock.", RuntimeWarning)

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", fake_init)
    monkeypatch.setenv("RAY_ADDRESS", "local")
    ensure_ray(ClusterConfig())
    assert not [w for w in recwarn if "os.fork()" in str(w.message)]


@pytest.mark.parametrize("address", ["local", "10.0.0.1:6379"])
def test_a_ray_that_does_not_start_is_one_line_naming_the_fix(monkeypatch, address):
    """ray.init's own failures (here the start-up timeout Ray raises on a loaded machine) were `internal error`."""
    import ray

    from orchestrator.slices import cluster
    from orchestrator.slices.cluster import ClusterConfig, RayDidNotStart, ensure_ray

    def timed_out(**kwargs):
        raise TimeoutError("Timed out after 30 seconds while waiting for node to startup. Did not find socket name "
                           "plasma_store in the list of object store socket names.")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", timed_out)
    monkeypatch.setattr(cluster, "check_answers", lambda address: None)
    monkeypatch.setenv("RAY_ADDRESS", address)
    with pytest.raises(RayDidNotStart) as e:
        ensure_ray(ClusterConfig())
    message = str(e.value)
    assert "\n" not in message and "TimeoutError: Timed out after 30 seconds" in message
    assert ("a local Ray did not start" in message and "set RAY_ADDRESS" in message) if address == "local" else \
        ("could not join the Ray cluster at 10.0.0.1:6379" in message and "ray status" in message)
