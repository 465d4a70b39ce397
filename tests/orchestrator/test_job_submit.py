"""`ray job submit -- pagefleet run ...` against a `ray start --head` cluster on loopback."""

import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from orchestrator.export import collect
from orchestrator.manifest import read_manifest

from .conftest import run_args, write_run_corpus

pytestmark = pytest.mark.ray
BIN = Path(sys.executable).parent


def free_ports(count: int) -> list[int]:
    socks = [socket.socket() for _ in range(count)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


@pytest.fixture
def ray_cluster():
    """A head node of its own (ports and temp dir apart from the test session's Ray), torn down after."""
    gcs, dashboard, client, agent, grpc, metrics, runtime_env = free_ports(7)
    temp = tempfile.mkdtemp(prefix="pf-ray-")  # short: Ray's unix socket paths must stay under 108 bytes
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PATH"] = f"{BIN}:{env.get('PATH', '')}"
    start = subprocess.run(
        [str(BIN / "ray"), "start", "--head", "--node-ip-address=127.0.0.1", f"--port={gcs}", "--num-cpus=2",
         "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}",
         f"--ray-client-server-port={client}", f"--dashboard-agent-listen-port={agent}",
         f"--dashboard-agent-grpc-port={grpc}", f"--metrics-export-port={metrics}",
         f"--runtime-env-agent-port={runtime_env}", f"--temp-dir={temp}", "--disable-usage-stats"],
        env=env, capture_output=True, text=True, timeout=180, start_new_session=True)
    assert start.returncode == 0, start.stdout + start.stderr
    try:
        yield f"http://127.0.0.1:{dashboard}", env
    finally:
        # Only this cluster's processes and their descendants: `ray stop` would also stop the test session's Ray.
        import psutil

        doomed = set()
        for proc in psutil.process_iter(["pid", "cmdline"]):
            cmdline = " ".join(proc.info["cmdline"] or [])
            if temp in cmdline or f"127.0.0.1:{gcs}" in cmdline:
                try:
                    doomed |= {proc, *proc.children(recursive=True)}
                except psutil.NoSuchProcess:
                    pass
        for proc in doomed:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        shutil.rmtree(temp, ignore_errors=True)


def test_ray_job_submit_runs_to_completion(ray_cluster, run_model, tmp_path):
    address, env = ray_cluster
    corpus = write_run_corpus(tmp_path / "corpus.jsonl", 16, seed=5)
    run_dir = tmp_path / "run"
    config = tmp_path / "run.yaml"
    config.write_text("name: submitted\n")
    args = run_args(run_model, corpus, run_dir, "--cluster.num_slices=1")
    submit = subprocess.run(
        [str(BIN / "ray"), "job", "submit", f"--address={address}", "--submission-id=pagefleet-test", "--",
         sys.executable, "-m", "orchestrator", "run", str(config), *args],
        env=env, capture_output=True, text=True, timeout=600)
    assert submit.returncode == 0, submit.stdout[-4000:] + submit.stderr[-4000:]
    assert "succeeded" in submit.stdout.lower(), submit.stdout[-4000:]
    records = read_manifest(run_dir / "batches.jsonl")
    assert records and all(r.status == "done" for r in records)
    assert collect(run_dir).num_rows == sum(r.num_prompts for r in records)
    # The job's driver connected to that cluster rather than starting a Ray of its own.
    logs = subprocess.run([str(BIN / "ray"), "job", "logs", f"--address={address}", "pagefleet-test"], env=env,
                          capture_output=True, text=True, timeout=60).stdout
    assert "Connecting to existing Ray cluster" in logs or "Connected to Ray cluster" in logs, logs[-3000:]
