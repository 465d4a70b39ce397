"""`pagefleet run` heads on a gs:// run directory (the Cloud Storage emulator): a second head is refused while the
first holds the lock; a head whose lock is taken from it notices within seconds, stops its slices, writes nothing
more there, and exits 2 with one line naming the fix (not only at its next manifest write)."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from orchestrator.storage import generations, storage
from orchestrator.state.manifest import read_manifest

from ..conftest import run_args, write_run_corpus
from ..run.test_crash import ROOT

STALE_S = 3.0  # refreshed every 0.5 s


def wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


@pytest.mark.slow  # one `pagefleet run` with its own Ray: a minute on a loaded 2-core machine
@pytest.mark.ray
def test_a_second_head_is_refused_and_a_head_whose_lock_is_taken_over_stops_promptly(run_model, tmp_path, gcs_bucket):
    corpus = write_run_corpus(tmp_path / "corpus.jsonl", 400, seed=3)  # far more than it gets to
    run_dir = f"{gcs_bucket}/runs/taken"
    config = tmp_path / "run.yaml"
    config.write_text("name: taken\n")
    args = run_args(run_model, corpus, run_dir, "--sampling.max_new_tokens=64", f"--lock_stale_s={STALE_S}")
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "PAGEFLEET_CRASH_AT")}
    env["PAGEFLEET_PROGRESS"] = "0"
    head = subprocess.Popen([sys.executable, "-m", "orchestrator", "run", str(config), *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    lock, events = f"{run_dir}/.lock", f"{run_dir}/events.log"
    try:
        wait_for(lambda: storage.exists(events) and "run started" in storage.read_text(events), 300, "the run to start")
        data, generation = generations.read_with_generation(lock)
        assert json.loads(data)["pid"] == head.pid
        # A second head, as a separate process, is refused while this one holds the lock (before starting Ray).
        second = subprocess.run([sys.executable, "-m", "orchestrator", "run", str(config), *args], cwd=ROOT, env=env,
                                capture_output=True, text=True, timeout=300)
        assert second.returncode == 2, second.stderr[-2000:]
        assert f"pagefleet run: run directory {run_dir} is in use by" in second.stderr, second.stderr[-2000:]
        assert f'"pid": {head.pid}' in second.stderr
        data, generation = generations.read_with_generation(lock)
        assert json.loads(data)["pid"] == head.pid and head.poll() is None
        # Another head takes the run over (as one would once this head's lock went stale).
        thief = json.dumps({"pid": 999999, "host": "another-machine", "since": time.time()}).encode()
        generations.replace_if_generation(lock, thief, generation)
        taken = time.monotonic()
        out, err = head.communicate(timeout=120)
        stopped_after_s = time.monotonic() - taken
    finally:
        try:
            os.killpg(head.pid, signal.SIGKILL)  # its local Ray goes with it
        except ProcessLookupError:
            pass
    assert head.returncode == 2, (head.returncode, out[-2000:], err[-2000:])
    said = [line for line in err.splitlines() if line.startswith("pagefleet run:")]
    assert len(said) == 1, err[-4000:]
    assert said[0].startswith(f"pagefleet run: lost the lock on run directory {run_dir}: another head took it over")
    assert "another-machine" in said[0] and "raise lock_stale_s" in said[0], said[0]
    assert not all(r.status == "done" for r in read_manifest(f"{run_dir}/batches.jsonl"))  # it did not run on
    assert stopped_after_s < 30, f"the head took {stopped_after_s:.0f} s to notice it lost its lock"
    assert storage.read_bytes(lock) == thief  # the new holder's lock is left alone
