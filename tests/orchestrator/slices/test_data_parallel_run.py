"""`pagefleet run` with data-parallel slices (`cluster.mesh: {data: D, model: T}` on one host of 4 devices): the
export holds every sample exactly once, with the tokens of one engine running the whole plan; a head SIGKILLed
mid-run resumes to the same export."""

import signal

import pytest

from orchestrator.config import load_run_config
from orchestrator.run.driver import Driver
from orchestrator.state.manifest import read_manifest

from ..conftest import run_args, write_run_corpus
from ..run.test_crash import pagefleet_run
from ..run.test_driver import assert_logprobs, reference, samples

pytestmark = [pytest.mark.ray, pytest.mark.slow]
SEEDED = ["--sampling.temperature=0.8", "--sampling.top_p=0.9", "--sampling.n=2", "--sampling.seed=3",
          "--sampling.logprobs=true",
          "--cluster.num_slices=1", "--cluster.devices_per_host=4"]


@pytest.mark.parametrize("mesh", ["{data: 2, model: 2}", "{data: 4, model: 1}"])
def test_data_parallel_slices_export_one_engines_samples(ray_local, run_model, tmp_path, mesh):
    corpus = write_run_corpus(tmp_path / "corpus.jsonl", 24)
    run_dir = tmp_path / "run"
    cfg = load_run_config(None, run_args(run_model, corpus, run_dir, *SEEDED, f"--cluster.mesh={mesh}"))
    outcome = Driver(cfg, show_progress=False).run()
    assert outcome.exit_code == 0 and outcome.summary["samples_done"] == 48
    engines = int(mesh.split("data: ")[1].split(",")[0])
    assert "slice-0 ready (pids" in (events := (run_dir / "events.log").read_text())
    assert f"{engines} data-parallel engines" in events
    assert samples(run_dir) == reference(run_model, run_dir, cfg)  # every sample once, one engine's tokens
    assert_logprobs(run_dir, run_model, cfg)  # model 1: bit-identical; model 2: within 1e-4
    timeline = (run_dir / "timeline.jsonl").read_text()
    assert all(f'"slice-0/{i}"' in timeline for i in range(engines)), "an engine took no step"


def test_a_killed_head_with_data_parallel_slices_resumes_to_the_same_export(ray_local, run_model, tmp_path):
    corpus = write_run_corpus(tmp_path / "corpus.jsonl", 24, seed=7)
    extra = [*SEEDED, "--cluster.mesh={data: 2, model: 2}", "--packing.max_prefill_steps=1"]
    config = tmp_path / "run.yaml"
    config.write_text("name: crash\n")
    run_dir = tmp_path / "crashed"
    args = run_args(run_model, corpus, run_dir, *extra)
    assert pagefleet_run(config, args, "output_written:2") == -signal.SIGKILL
    batches = read_manifest(run_dir / "batches.jsonl")
    assert len(list((run_dir / "outputs").glob("*.parquet"))) >= 2 and len(batches) > 2  # killed mid-run
    assert not all(r.status == "done" for r in batches)
    assert pagefleet_run(config, args, None) == 0
    cfg = load_run_config(config, args)
    assert samples(run_dir) == reference(run_model, run_dir, cfg)
    assert_logprobs(run_dir, run_model, cfg)
