"""Multi-host slices on a local Ray: each slice is a gang of host actors running one SPMD program.

CPU hosts stand in for TPU hosts: each host actor is its own process with `devices_per_host` XLA
devices, joined by jax.distributed (gloo collectives).
"""

import dataclasses
import os
import signal

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import orchestrator.slices.slice_gang as slice_gang
from orchestrator import exit_codes
from orchestrator.config import load_run_config
from orchestrator.run.driver import Driver
from orchestrator.state.manifest import read_manifest
from orchestrator.state.run_events import SlicesReady

from ..conftest import run_args, write_run_corpus
from ..run.test_driver import reference, samples, start_together

pytestmark = [pytest.mark.ray, pytest.mark.multihost]


def gang_args(hosts: int, devices: int, model: int, slices: int = 1) -> list[str]:
    return [f"--cluster.num_slices={slices}", f"--cluster.hosts_per_slice={hosts}",
            f"--cluster.devices_per_host={devices}", f"--cluster.mesh={{model: {model}}}",
            f"--cluster.resources_per_host={{CPU: {2 / (hosts * slices)}}}", "--cluster.placement_strategy=PACK"]


# Seeded sampling across hosts is also covered at the engine level (tests/engine/test_multihost.py); the
# run-level seeded case is slow-only to keep the default run near 20 minutes on 2 cores.
@pytest.mark.parametrize("sampling", [[], pytest.param(["--sampling.temperature=0.8", "--sampling.top_p=0.9",
                                                         "--sampling.n=2"], marks=pytest.mark.slow)],
                         ids=["greedy", "seeded"])
def test_two_host_slice_equals_one_process(ray_local, run_model, tmp_path, sampling):
    corpus = write_run_corpus(tmp_path / "corpus.jsonl", 16, seed=11)
    run_dir = tmp_path / "run"
    cfg = load_run_config(None, run_args(run_model, corpus, run_dir, *gang_args(2, 2, 2), *sampling))
    outcome = Driver(cfg, show_progress=False).run()
    assert outcome.exit_code == 0, outcome.summary
    assert samples(run_dir) == reference(run_model, run_dir, cfg)
    events = (run_dir / "events.log").read_text()
    assert "slice-0 ready" in events and ", 4 devices," in events  # one mesh over both hosts' devices


def test_two_slices_of_two_hosts_at_once(ray_local, run_model, tmp_path, monkeypatch):
    """One device a host and mesh.model = 2: tensor parallel across the two processes of each slice."""
    start_together(monkeypatch)
    corpus = write_run_corpus(tmp_path / "corpus.jsonl", 24, seed=12)
    run_dir = tmp_path / "run"
    cfg = load_run_config(None, run_args(run_model, corpus, run_dir, *gang_args(2, 1, 2, slices=2)))
    assert Driver(cfg, show_progress=False).run().exit_code == 0
    records = read_manifest(run_dir / "batches.jsonl")
    assert {r.slice for r in records} == {"slice-0", "slice-1"}  # both gangs up at once, 4 host processes
    assert samples(run_dir) == reference(run_model, run_dir, cfg)


def test_host_with_another_config_is_caught_before_any_step(ray_local, run_model, tmp_path, monkeypatch, capsys):
    real = slice_gang.SliceSpec

    def host_1_differs(*args, **kwargs):
        spec = real(*args, **kwargs)
        if spec.host_index == 1:
            spec = dataclasses.replace(spec, engine=dataclasses.replace(spec.engine, max_pages=spec.engine.max_pages + 8))
        return spec

    monkeypatch.setattr(slice_gang, "SliceSpec", host_1_differs)
    corpus = write_run_corpus(tmp_path / "corpus.jsonl", 8, seed=13)
    run_dir = tmp_path / "run"
    cfg = load_run_config(None, run_args(run_model, corpus, run_dir, *gang_args(2, 1, 2),
                                         "--cluster.max_slice_restarts=0", "--cluster.host_timeout_s=120"))
    outcome = Driver(cfg, show_progress=False).run()
    assert outcome.exit_code == exit_codes.FAULT and outcome.summary["batches_done"] == 0
    assert "could not start" in outcome.fault and "engine_config" in outcome.fault, outcome.fault
    assert all(r.attempts == 0 for r in read_manifest(run_dir / "batches.jsonl"))  # no batch ever ran


def test_host_given_another_batch_fails_that_batch_only(ray_local, run_model, tmp_path, monkeypatch):
    real_submit = slice_gang.SliceGang.submit

    def changed(path: str) -> str:
        """A copy of the batch file with one token of its first prompt changed."""
        table = pq.read_table(path)
        ids = table["token_ids"].to_pylist()
        ids[0] = ids[0][:-1] + [(ids[0][-1] + 1) % 500]
        other = tmp_path / "other.parquet"
        pq.write_table(table.set_column(2, "token_ids", pa.array(ids, table.schema.field("token_ids").type)), other)
        return str(other)

    def submit(self, batch_id, attempt, num_prompts, num_samples):
        if batch_id != "b000000":
            return real_submit(self, batch_id, attempt, num_prompts, num_samples)
        host_1 = self.actors[1]

        class Host1:  # is sent a reference to another file than host 0's
            class submit:
                @staticmethod
                def remote(work):
                    return host_1.submit.remote(dataclasses.replace(work, path=changed(work.path)))

        self.actors[1] = Host1
        try:
            real_submit(self, batch_id, attempt, num_prompts, num_samples)
        finally:
            self.actors[1] = host_1

    monkeypatch.setattr(slice_gang.SliceGang, "submit", submit)
    corpus = write_run_corpus(tmp_path / "corpus.jsonl", 12, seed=14)
    run_dir = tmp_path / "run"
    cfg = load_run_config(None, run_args(run_model, corpus, run_dir, *gang_args(2, 1, 2), "--retry.max_attempts=2"))
    outcome = Driver(cfg, show_progress=False).run()
    assert outcome.exit_code == 1
    records = {r.batch_id: r for r in read_manifest(run_dir / "batches.jsonl")}
    assert records["b000000"].status == "failed" and records["b000000"].attempts == 2
    assert "requests" in records["b000000"].error, records["b000000"].error
    assert all(r.status == "done" for k, r in records.items() if k != "b000000")


def test_host_killed_mid_batch_restarts_the_slice(ray_local, run_model, tmp_path):
    corpus = write_run_corpus(tmp_path / "corpus.jsonl", 16, seed=15)
    run_dir = tmp_path / "run"
    cfg = load_run_config(None, run_args(run_model, corpus, run_dir, *gang_args(2, 1, 2)))
    driver = Driver(cfg, show_progress=False)
    killed = {}

    def kill_host_1(event):
        if isinstance(event, SlicesReady):
            killed["batches"] = event.slices[0].batches
            os.kill(event.slices[0].pids[1], signal.SIGKILL)

    driver.events.subscribe(kill_host_1)
    assert driver.run().exit_code == 0
    assert killed["batches"]
    records = {r.batch_id: r for r in read_manifest(run_dir / "batches.jsonl")}
    assert all(records[b].attempts == 2 for b in killed["batches"])
    events = (run_dir / "events.log").read_text()
    assert "slice-0 died (host 1)" in events and "slice-0 restarting" in events
    assert samples(run_dir) == reference(run_model, run_dir, cfg)


@pytest.mark.slow
def test_hung_host_times_out_and_the_slice_comes_back(ray_local, run_model, tmp_path):
    corpus = write_run_corpus(tmp_path / "corpus.jsonl", 16, seed=16)
    run_dir = tmp_path / "run"
    cfg = load_run_config(None, run_args(run_model, corpus, run_dir, *gang_args(2, 1, 2), "--cluster.host_timeout_s=45"))
    driver = Driver(cfg, show_progress=False)
    stopped = {}

    def stop_host_1(event):
        if isinstance(event, SlicesReady):
            stopped["pid"] = event.slices[0].pids[1]
            os.kill(stopped["pid"], signal.SIGSTOP)  # alive but silent: host 0 waits in a collective

    driver.events.subscribe(stop_host_1)
    try:
        assert driver.run().exit_code == 0
    finally:
        try:
            os.kill(stopped["pid"], signal.SIGKILL)
        except (KeyError, ProcessLookupError):
            pass
    events = (run_dir / "events.log").read_text()
    assert "took no engine step" in events and "slice-0 restarting" in events
    assert samples(run_dir) == reference(run_model, run_dir, cfg)


@pytest.mark.slow
@pytest.mark.parametrize("model_axis", [2, 4])
def test_one_kv_head_over_a_two_host_slice_equals_one_process(ray_local, tmp_path, model_axis):
    """tiny-mistral has one KV head: at model 2 (data 2 x model 2 over the 4 devices) and model 4 (across both
    hosts) each device holds a copy of it; seeded samples, n = 2, every one once, one device's tokens."""
    from engine.models.presets import write_model

    model = str(write_model("tiny-mistral", tmp_path / "tiny-mistral"))
    corpus = write_run_corpus(tmp_path / "corpus.jsonl", 12, seed=13)
    run_dir = tmp_path / "run"
    cfg = load_run_config(None, run_args(model, corpus, run_dir, *gang_args(2, 2, model_axis),
                                         "--sampling.temperature=0.8", "--sampling.top_p=0.9", "--sampling.n=2"))
    outcome = Driver(cfg, show_progress=False).run()
    assert outcome.exit_code == 0, outcome.summary
    assert samples(run_dir) == reference(model, run_dir, cfg)
