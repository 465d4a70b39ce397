"""`pagefleet status` and `pagefleet export` on a gs:// run directory (the Cloud Storage emulator), each run as
a separate process, as from a laptop while the head runs elsewhere."""

import json
import os
import subprocess
import sys

import pytest

from orchestrator.storage import storage
from orchestrator.state.object_lock import ObjectRunLock
from tests.gcs_emulator import upload

from ..export.test_export import approx, make_run, read_output


def pagefleet(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    return subprocess.run([sys.executable, "-m", "orchestrator", *args], capture_output=True, text=True, env=env,
                          timeout=300)


@pytest.mark.slow  # separate processes for status and export: several seconds
def test_status_and_export_of_a_gs_run_directory_from_another_process(gcs_bucket, tmp_path):
    expected = make_run(tmp_path / "run")
    run_dir = upload(str(tmp_path / "run"), f"{gcs_bucket}/runs/r1")

    s = pagefleet("status", "--json", run_dir)
    assert s.returncode == 0, s.stderr
    figures = json.loads(s.stdout)
    assert figures["run_dir"] == run_dir and figures["head"] is None
    assert figures["counts"]["done"] == figures["batches"] == 14 and figures["samples_done"] == len(expected)
    with ObjectRunLock(run_dir):  # a head holds the run directory (on another machine, as far as status knows)
        s = pagefleet("status", run_dir)
    assert s.returncode == 0 and f"running (pid {os.getpid()} on " in s.stdout, s.stdout + s.stderr

    for output, memory_gb in ((f"{gcs_bucket}/exports/all.jsonl", "2"), (f"{gcs_bucket}/exports/all.parquet", "0.00001")):
        e = pagefleet("export", run_dir, "--output", output, "--no-progress", "--memory-gb", memory_gb)
        assert e.returncode == 0, e.stderr
        local = tmp_path / output.rsplit("/", 1)[-1]
        local.write_bytes(storage.read_bytes(output))
        assert approx(read_output(local)) == approx(expected), output
    assert storage.list_names(f"{gcs_bucket}/exports") == ["all.jsonl", "all.parquet"]  # nothing else left there


def test_export_names_a_missing_output_on_gs(gcs_bucket, tmp_path):
    make_run(tmp_path / "run", num_batches=3, num_rows=20)
    run_dir = upload(str(tmp_path / "run"), f"{gcs_bucket}/runs/r2")
    storage.remove(f"{run_dir}/outputs/b000001.parquet")
    e = pagefleet("export", run_dir, "--output", str(tmp_path / "out.jsonl"), "--no-progress")
    assert e.returncode != 0
    assert f"{run_dir}/outputs/b000001.parquet is missing" in e.stderr, e.stderr
