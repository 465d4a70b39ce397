from pathlib import Path

import pytest

from orchestrator.config import ConfigError, RunConfig, diff_keys, load_run_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("**/*.yaml")), ids=lambda p: p.name)
def test_every_config_loads(path):
    assert isinstance(load_run_config(path), RunConfig)


def test_design_keys_exist_and_overrides_apply(tmp_path):
    yaml = tmp_path / "run.yaml"
    yaml.write_text("name: x\ncorpus: {path: a.jsonl}\ncluster: {mesh: {model: 2}}\n")
    cfg = load_run_config(yaml, ["--sampling.n=4", "--engine.max_seqs=64", "--packing.page_budget=100"])
    assert (cfg.sampling.n, cfg.engine.max_seqs, cfg.packing.page_budget, cfg.cluster.mesh) == (4, 64, 100, {"model": 2})
    assert cfg.resolved_run_dir == "manifests/x"
    for key in ("corpus.id_field", "corpus.text_field", "corpus.messages_field", "model.tokenizer", "model.dtype",
                "sampling.top_k", "sampling.stop", "sampling.logprobs", "engine.reset_mode", "engine.cleanup_mode",
                "packing.prefill_budget", "cluster.devices_per_host", "cluster.hosts_per_slice", "retry.max_attempts",
                "tracker.type", "tracker.project", "tracker.mode"):
        section, name = key.split(".")
        assert hasattr(getattr(cfg, section), name), key


@pytest.mark.parametrize("text, args, message", [
    ("corpus: {pth: a}\n", [], "pth"),
    ("name: x\n", ["--corpus.nope=1"], "nope"),
    ("name: x\n", ["--sampling.n=0"], "sampling.n"),
    ("tracker: {type: tensorboard}\n", [], "tracker"),
    ("name: x\n", ["--engine.kv_memory_gib=4"], "identical on every host: set engine.max_pages"),
    ("name: x\n", ["--engine.preemption=swap"], "engine.preemption=swap needs a host pool: set engine.host_kv_pages > 0"),
])
def test_bad_configs_name_the_key(tmp_path, text, args, message):
    yaml = tmp_path / "run.yaml"
    yaml.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_run_config(yaml, args)


def test_diff_keys_names_changes():
    a = RunConfig().sample_affecting()
    b = load_run_config(None, ["--sampling.max_new_tokens=8", "--corpus.shard_bytes=10"]).sample_affecting()
    assert diff_keys(a, b) == ["sampling.max_new_tokens: 256 -> 8"]


@pytest.mark.parametrize("text, args, message", [
    ("name: x\ncorpus: {path: a\n  b: [\n", [], r"run.yaml: invalid YAML at line 3, column 4: expected ',' or '}'"),
    ("- a\n- b\n", [], r"run.yaml: a run config is a mapping of keys \(see docs/config.md\), not a YAML list"),
    ("name: x\ncluster:\n  mesh: 1\n", [], r"run.yaml: cluster.mesh must be a mapping, got an integer \(1\) \(keys in docs/config.md\)"),
    ("name: x\n", ["--sampling.max_new_tokens"], r"^argument --sampling.max_new_tokens: expected one argument"),
    ("tracker: {type: tensorboard}\n", [], r"tracker.type must be one of 'wandb', 'noop', got a string \('tensorboard'\)"),
    ("name: x\nmodel: {dtype: float16}\n", [], r"model.dtype must be one of 'bfloat16', 'float32'"),
    ("name: x\n", ["--corpus.nope=1"], r"unrecognized arguments: --corpus.nope=1; .*docs/config.md"),
])
def test_config_errors_are_one_line_naming_the_file_or_key(tmp_path, text, args, message):
    yaml = tmp_path / "run.yaml"
    yaml.write_text(text)
    with pytest.raises(ConfigError, match=message) as e:
        load_run_config(yaml, args)
    assert "\n" not in str(e.value) and "DESIGN" not in str(e.value)


def test_max_seqs_in_prefill_follows_a_smaller_max_seqs_unless_set(tmp_path):
    assert load_run_config(None, ["--engine.max_seqs=4"]).engine.max_seqs_in_prefill == 4
    assert load_run_config(None, ["--engine.max_seqs=64"]).engine.max_seqs_in_prefill == 8
    assert load_run_config(None, ["--engine.max_seqs=64", "--engine.max_seqs_in_prefill=2"]).engine.max_seqs_in_prefill == 2
    with pytest.raises(ConfigError, match=r"engine.max_seqs_in_prefill \(8\) exceeds engine.max_seqs \(4\)"):
        load_run_config(None, ["--engine.max_seqs=4", "--engine.max_seqs_in_prefill=8"])


def test_the_model_dtypes_are_the_engines():
    """model.dtype accepts exactly the dtypes the engine runs: any other is refused as the config loads."""
    import typing

    from engine import DTYPES
    from orchestrator.plan.model_source import ModelSourceConfig

    assert typing.get_args(typing.get_type_hints(ModelSourceConfig)["dtype"]) == DTYPES
    with pytest.raises(ConfigError, match="model.dtype"):
        load_run_config(None, ["--model.dtype=float16"])


def test_a_host_pool_on_a_multi_host_slice_loads(tmp_path):
    """Each host moves its own shards of the pool (engine/kv/host_pool.py): the head no longer refuses it."""
    yaml = tmp_path / "run.yaml"
    yaml.write_text("name: x\n")
    cfg = load_run_config(yaml, ["--engine.host_kv_pages=8", "--engine.preemption=swap", "--cluster.hosts_per_slice=2"])
    assert cfg.engine.host_kv_pages == 8 and cfg.cluster.hosts_per_slice == 2


@pytest.mark.parametrize("args, message", [
    (["--sampling.max_new_token=3"], "(did you mean sampling.max_new_tokens?)"),
    (["--smpling.max_new_tokens=3"], "(did you mean sampling.max_new_tokens?)"),
])
def test_a_misspelt_key_names_the_nearest_one(args, message):
    with pytest.raises(ConfigError) as e:
        load_run_config(None, args)
    assert message in str(e.value)


def test_a_misspelt_key_in_a_file_or_a_python_override_names_the_nearest_one(tmp_path):
    import pagefleet

    bad = tmp_path / "bad.yaml"
    bad.write_text("sampling: {max_new_token: 3}\n")
    with pytest.raises(ConfigError, match=r"max_new_token .*\(did you mean sampling\.max_new_tokens\?\)"):
        load_run_config(bad, [])
    with pytest.raises(ConfigError, match=r"smpling .*\(did you mean sampling\?\)"):
        pagefleet.load_config(None, smpling={"n": 2})
    with pytest.raises(ConfigError) as far:
        load_run_config(None, ["--colour=3"])
    assert "did you mean" not in str(far.value)  # nothing close: no guess
