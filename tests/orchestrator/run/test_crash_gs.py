"""Crash safety with the run directory in a bucket (the Cloud Storage emulator): `pagefleet run` SIGKILLed at
named points, then rerun once its lock is stale, loses, duplicates and recomputes nothing."""

import signal
import time

import pytest

from orchestrator.storage import generations, storage
from orchestrator.config import load_run_config
from orchestrator.run.driver import Driver
from orchestrator.state.manifest import read_manifest
from tests.gcs_emulator import upload

from ..conftest import run_args, write_run_corpus
from .test_crash import pagefleet_run, records

pytestmark = pytest.mark.ray
STALE_S = 2.0


def done_outputs(run_dir: str) -> dict[str, int]:
    """Batches marked done -> the generation of their output object (a rewrite would give a new one)."""
    return {r.batch_id: generations.object_info(f"{run_dir}/{r.output}")["generation"]
            for r in read_manifest(f"{run_dir}/batches.jsonl") if r.status == "done"}


@pytest.mark.slow  # a baseline and five `pagefleet run` processes, each starting its own Ray: minutes
def test_killed_head_resumes_from_a_gs_run_dir(ray_local, run_model, tmp_path, gcs_bucket):
    corpus = write_run_corpus(tmp_path / "corpus.jsonl", 40, seed=7)
    extra = ["--packing.max_prefill_steps=1"]
    config = tmp_path / "run.yaml"
    config.write_text("name: crash\n")
    baseline = tmp_path / "uninterrupted"
    assert Driver(load_run_config(config, run_args(run_model, corpus, baseline, *extra)), show_progress=False
                  ).run().exit_code == 0
    expected = records(baseline)

    run_dir = f"{gcs_bucket}/runs/crashed"
    args = run_args(upload(run_model, f"{gcs_bucket}/models/tiny"), upload(corpus, f"{gcs_bucket}/data/c.jsonl"),
                    run_dir, *extra, f"--model.cache_dir={tmp_path / 'cache'}", f"--lock_stale_s={STALE_S}")
    done_before: dict[str, int] = {}
    for point in ["planned", "dispatched:2", "output_written:2", "manifest_written:2", None]:
        events = storage.read_text(f"{run_dir}/events.log") if storage.exists(f"{run_dir}/events.log") else ""
        code = pagefleet_run(config, args, point)
        assert code == (0 if point is None else -signal.SIGKILL), f"the run was not killed at {point}"
        now = done_outputs(run_dir) if storage.exists(f"{run_dir}/batches.jsonl") else {}
        for batch_id, generation in done_before.items():
            assert now.get(batch_id) == generation, f"{batch_id} was recomputed after the kill at {point}"
        new_events = storage.read_text(f"{run_dir}/events.log")[len(events):].splitlines()
        started = [line.split()[1] for line in new_events if " running on " in line]
        assert not set(started) & set(done_before), f"done batches were dispatched again after {point}"
        done_before = now
        if point is not None:
            assert storage.exists(f"{run_dir}/.lock")  # the killed head's lock stays behind ...
            time.sleep(STALE_S + 0.5)  # ... until it is stale; the next head takes it over
    assert not storage.exists(f"{run_dir}/.lock")
    assert all(r.status == "done" for r in read_manifest(f"{run_dir}/batches.jsonl"))
    assert records(run_dir) == expected
