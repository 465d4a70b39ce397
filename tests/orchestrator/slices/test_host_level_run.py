"""Host-level data parallelism on a local Ray: a slice of 2 CPU hosts x 2 devices with `cluster.mesh.data` > 1 runs
data / hosts engines on each host, as independent JAX processes (no jax.distributed: nothing crosses hosts); the
export is one engine's, every sample once. The TPU environment that makes a pod host run alone is checked here
as data (no TPU on this machine)."""

import pytest

from orchestrator.config import load_run_config
from orchestrator.run.driver import Driver
from orchestrator.state.manifest import read_manifest
from orchestrator.slices.tpu_placement import single_host_tpu_env

from ..conftest import run_args, write_run_corpus
from ..run.test_driver import assert_logprobs, reference, samples

SEEDED = ["--sampling.temperature=0.8", "--sampling.top_p=0.9", "--sampling.n=2", "--sampling.seed=3",
          "--sampling.logprobs=true"]


def host_level_args(mesh: str) -> list[str]:
    return ["--cluster.num_slices=1", "--cluster.hosts_per_slice=2", "--cluster.devices_per_host=2",
            f"--cluster.mesh={mesh}", "--cluster.resources_per_host={CPU: 1}", "--cluster.placement_strategy=PACK",
            "--packing.max_prefill_steps=1"]


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.parametrize("mesh, engines", [("{data: 2, model: 2}", 2), ("{data: 4, model: 1}", 4)])
def test_each_host_runs_its_own_engines_and_nothing_crosses_hosts(ray_local, run_model, tmp_path, mesh, engines):
    corpus = write_run_corpus(tmp_path / "corpus.jsonl", 24, seed=5)
    run_dir = tmp_path / "run"
    cfg = load_run_config(None, run_args(run_model, corpus, run_dir, *SEEDED, *host_level_args(mesh)))
    outcome = Driver(cfg, show_progress=False).run()
    assert outcome.exit_code == 0, outcome.summary
    events = (run_dir / "events.log").read_text()
    # Both hosts' devices, the slice's engines, and each host a JAX process of its own (process_count 1 there).
    assert f", 4 devices, {engines} data-parallel engines, each host its own JAX process," in events, events
    assert samples(run_dir) == reference(run_model, run_dir, cfg)  # every sample once, one engine's tokens
    assert_logprobs(run_dir, run_model, cfg)  # model 1: bit-identical; model 2: within 1e-4
    assert len(read_manifest(run_dir / "batches.jsonl")) > 2
    timeline = (run_dir / "timeline.jsonl").read_text()  # engines numbered across hosts: both hosts took batches
    assert all(f'"slice-0/{i}"' in timeline for i in (0, engines - 1)), timeline[-2000:]


def test_the_tpu_environment_makes_a_pod_host_a_slice_of_its_own():
    env = single_host_tpu_env(4)  # a v5p host
    assert env["TPU_HOST_BOUNDS"] == env["TPU_PROCESS_BOUNDS"] == "1,1,1"
    assert env["TPU_CHIPS_PER_HOST_BOUNDS"] == env["TPU_CHIPS_PER_PROCESS_BOUNDS"] == "2,2,1"
    assert env["TPU_VISIBLE_CHIPS"] == "0,1,2,3" and env["RAY_EXPERIMENTAL_NOSET_TPU_VISIBLE_CHIPS"] == "1"
    assert single_host_tpu_env(8)["TPU_CHIPS_PER_HOST_BOUNDS"] == "2,4,1"
