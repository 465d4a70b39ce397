"""The head's validation of the slice layout (orchestrator/slices/slice_layout.py): a mesh that does not fit the slice's
devices or the model's heads, or capacities that cannot hold the model's context, end `pagefleet run` before any
slice starts (no Ray, no run directory), in one line naming the key; a slice that still meets such a fault is not
restarted."""

import json
from pathlib import Path

import pytest

from orchestrator.run import driver as driver_module
from orchestrator import exit_codes
from orchestrator.commands.cli import main
from orchestrator.config import load_run_config
from orchestrator.observe.status import format_status, status
from orchestrator.run.driver import Driver
from orchestrator.slices.slice_layout import validate

from ..conftest import run_args, write_run_corpus

MQA = dict(model_type="llama", hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=1, head_dim=16, vocab_size=512, max_position_embeddings=256)


@pytest.fixture
def mqa_model(tmp_path):
    """A config.json with one KV head and four attention heads (the head reads nothing else)."""
    path = tmp_path / "mqa"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(MQA))
    return str(path)


def cfg(model: str, *extra: str):
    return load_run_config(None, [f"--model.path={model}", "--corpus.path=unused.jsonl", "--engine.max_seq_len=128",
                                  "--engine.page_size=8", "--engine.max_pages=96", *extra])


@pytest.mark.parametrize("hosts,devices,mesh", [(1, 2, "{model: 2}"), (1, 4, "{model: 4}"), (1, 4, "{data: 2, model: 2}"),
                                                (1, 4, "{data: 4, model: 1}"), (1, 4, "{model: 1}"),
                                                (2, 2, "{data: 2, model: 2}"), (2, 2, "{model: 4}")])
def test_layouts_that_fit_pass(mqa_model, hosts, devices, mesh):
    model, context = validate(cfg(mqa_model, f"--cluster.hosts_per_slice={hosts}",
                                  f"--cluster.devices_per_host={devices}", f"--cluster.mesh={mesh}"))
    assert model.num_kv_heads == 1 and context == 128


@pytest.mark.parametrize("extra,needles", [
    # 3 is a multiple of the one KV head but does not divide the 4 attention heads
    (["--cluster.devices_per_host=3", "--cluster.mesh={model: 3}"],
     ["cluster.mesh.model=3: the model's 1 KV heads and 4 attention heads cannot be split over 3 devices",
      "one of [1, 2, 4]"]),
    (["--cluster.devices_per_host=4", "--cluster.mesh={data: 1, model: 2}"],
     ["cluster.mesh data=1 x model=2 = 2 devices, but the slice's 4 devices", "choose data x model = 4"]),
    (["--cluster.hosts_per_slice=2", "--cluster.devices_per_host=2", "--cluster.mesh={data: 1, model: 2}"],
     ["cluster.mesh data=1 x model=2 = 2 devices", "cluster.hosts_per_slice=2 x 2 devices per host"]),
    (["--cluster.hosts_per_slice=2", "--cluster.devices_per_host=3", "--cluster.mesh={data: 3, model: 2}"],
     ["cluster.mesh.data=3 does not divide over cluster.hosts_per_slice=2 hosts", "choose a multiple of 2"]),
    (["--cluster.resources_per_host={TPU: 4}", "--cluster.mesh={model: 8}"],
     ["cluster.mesh.model=8 does not divide the slice's 4 devices"]),
    (["--cluster.mesh={tensor: 2}"], ["cluster.mesh has unknown axis 'tensor'"]),
    (["--engine.max_pages=8"], ["engine.max_pages=8 pages of 8 tokens hold 64 tokens", "raise engine.max_pages"]),
])
def test_layouts_that_cannot_work_are_named(mqa_model, extra, needles):
    with pytest.raises(ValueError) as e:
        validate(cfg(mqa_model, *extra))
    assert "\n" not in str(e.value) and all(n in str(e.value) for n in needles), str(e.value)


def test_the_head_reads_generation_config_json_and_refuses_a_bad_one(mqa_model):
    """The EOS ids the slices will stop at are the head's too, and a broken file stops the run at the head."""
    (Path(mqa_model) / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 106]}))
    model, _ = validate(cfg(mqa_model))
    assert model.eos_token_ids == (2, 106)
    (Path(mqa_model) / "generation_config.json").write_text('{"eos_token_id": 2,}')
    with pytest.raises(ValueError, match=r"^\S*generation_config.json is not valid JSON .*; fix it, or remove it") as e:
        validate(cfg(mqa_model))
    assert "\n" not in str(e.value)


def test_a_mesh_the_model_cannot_use_ends_the_run_before_any_slice(run_model, tmp_path, capsys, monkeypatch):
    """tiny-llama (2 KV heads, 4 attention heads) at model 3: exit FAULT in one line; Ray never started, the run
    directory never made (before this check, three slice restarts each met the sharding error)."""
    from orchestrator.plan import tokenized

    started = []  # an earlier test of the session may have left Ray running: watch this run's own calls
    for module in (driver_module, tokenized):  # every caller of ensure_ray on the way to a slice
        monkeypatch.setattr(module, "ensure_ray", lambda *a, **k: started.append((a, k)))
    corpus = write_run_corpus(tmp_path / "corpus.jsonl", 4)
    run_dir = tmp_path / "run"
    config = tmp_path / "run.yaml"
    config.write_text("name: test\n")
    capsys.readouterr()
    code = main(["run", str(config), *run_args(run_model, corpus, run_dir, "--cluster.num_slices=1", "--cluster.devices_per_host=3",
                                  "--cluster.mesh={model: 3}")])
    err = capsys.readouterr().err.strip()
    assert code == exit_codes.FAULT
    assert err.startswith("pagefleet run: cluster.mesh.model=3: ") and "\n" not in err, err
    assert not run_dir.exists() and not started


@pytest.mark.ray
@pytest.mark.parametrize("flags, names", [
    (("--cluster.devices_per_host=3", "--cluster.mesh={model: 3}"), "cluster.mesh.model=3"),
    (("--engine.preemption=swap", "--engine.host_kv_pages=1000000000000"), "engine.host_kv_pages=1,000,000,000,000"),
], ids=["mesh", "host-pool"])
def test_a_slice_that_meets_a_configuration_error_is_not_restarted(ray_local, run_model, tmp_path, monkeypatch,
                                                                    flags, names):
    """A configuration error that only a slice can see (the host's memory) or that the head's check missed (a
    mesh the model cannot be sharded over) stops the run at the first start, with no restart, naming the key."""
    monkeypatch.setattr(driver_module, "validate", lambda cfg: None)
    corpus = write_run_corpus(tmp_path / "corpus.jsonl", 4)
    run_dir = tmp_path / "run"
    config = load_run_config(None, run_args(run_model, corpus, run_dir, "--cluster.num_slices=1", *flags,
                                            "--cluster.max_slice_restarts=3"))
    outcome = Driver(config, show_progress=False).run()
    assert outcome.exit_code == exit_codes.FAULT and names in outcome.fault, outcome.fault
    figures = status(run_dir)  # a user back at a stopped run sees why it stopped, without reading events.log
    assert figures["fault"] == outcome.fault and f"stopped on     {outcome.fault}" in format_status(figures)
    events = (run_dir / "events.log").read_text()
    assert "slice-0 could not start" in events and "restarting cannot help" in events
    assert "slice-0 restarting" not in events


def test_the_heads_budget_scales_with_the_engines_of_a_slice(mqa_model):
    """Twice every engine's slots by default: D engines, D times the budget (an explicit value is the slice's)."""
    one = cfg(mqa_model, "--cluster.devices_per_host=4", "--engine.max_seqs=8")
    four = cfg(mqa_model, "--cluster.devices_per_host=4", "--engine.max_seqs=8", "--cluster.mesh={data: 4, model: 1}")
    hosts = cfg(mqa_model, "--cluster.hosts_per_slice=2", "--cluster.devices_per_host=2", "--engine.max_seqs=8",
                "--cluster.mesh={data: 4, model: 1}")
    assert (one.samples_in_flight_per_slice, four.samples_in_flight_per_slice) == (16, 64)
    assert hosts.samples_in_flight_per_slice == 64
    explicit = cfg(mqa_model, "--cluster.mesh={data: 4, model: 1}", "--cluster.samples_in_flight_per_slice=10")
    assert explicit.samples_in_flight_per_slice == 10


def test_the_service_refuses_a_mesh_the_model_cannot_use_at_submit(run_model, tmp_path, monkeypatch):
    """POST /runs runs the head's own validation (slice_layout.validate, the same code as `pagefleet run`): a mesh
    that fits the devices but not the model's heads is a ConfigError (HTTP 400) naming the key, and no run starts.
    (It passed the service's mesh-vs-devices check and failed later in the run's background thread.)"""
    from pathlib import Path

    from orchestrator.config import ConfigError
    from orchestrator.service.service_paths import DataPolicy
    from orchestrator.service.service_runs import RunRegistry

    monkeypatch.setattr(RunRegistry, "_execute", lambda self, name: pytest.fail("a run started"))
    corpus = write_run_corpus(tmp_path / "corpus.jsonl", 4)
    registry = RunRegistry(tmp_path / "runs", DataPolicy.build([str(tmp_path), str(Path(run_model).parent)], [],
                                                               str(tmp_path)))
    cfg = load_run_config(None, run_args(run_model, corpus, tmp_path / "runs" / "test", "--cluster.num_slices=1",
                                         "--cluster.devices_per_host=3", "--cluster.mesh={model: 3}"))
    with pytest.raises(ConfigError) as e:
        registry.submit(cfg)
    assert str(e.value).startswith("cluster.mesh.model=3: ") and "\n" not in str(e.value), str(e.value)
    assert registry.names() == [] and not (tmp_path / "runs" / "test").exists()
