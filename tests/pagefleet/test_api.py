"""The Python API (`import pagefleet`) as a notebook uses it: the same records as `pagefleet generate`."""

from __future__ import annotations

import json

import pytest

import pagefleet
from engine.models.presets import write_model
from orchestrator.config import ConfigError, RunConfig
from orchestrator.commands.generate import main as generate_main
from orchestrator.state.rundir import PlanMismatch


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(write_model("tiny-llama", tmp_path_factory.mktemp("m")))


def test_generate_returns_the_records_pagefleet_generate_writes(tmp_path, model_dir, monkeypatch):
    """Through a Hub id in a local Hub cache (offline) for the API, the directory for the command."""
    from tests.orchestrator.plan.test_model_source import hub_cache

    hub_cache(tmp_path / "hub", "org/tiny", model_dir)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    prompts = ["Hello there", [{"role": "user", "content": "hi"}], [5, 6, 7], "", {"id": "own", "prompt": "sea"}]
    sampling = {"max_new_tokens": 5, "temperature": 0.7, "seed": 3, "n": 2, "logprobs": True}
    engine_keys = {"max_seq_len": 128, "max_pages": 32, "max_seqs": 4}
    records = pagefleet.generate("org/tiny", prompts, engine=engine_keys, **sampling)

    rows = [{"id": 0, "prompt": "Hello there"}, {"id": 1, "messages": [{"role": "user", "content": "hi"}]},
            {"id": 2, "prompt_token_ids": [5, 6, 7]}, {"id": 3, "prompt": ""}, {"id": "own", "prompt": "sea"}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["--model", model_dir, "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl"),
            "--progress=false", *(f"--sampling.{k}={str(v).lower()}" for k, v in sampling.items()),
            *(f"--engine.{k}={v}" for k, v in engine_keys.items())]
    assert generate_main(args) == 0
    assert records == [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [(r["prompt_id"], r["generation_index"]) for r in records] == [
        (p, g) for p in [0, 1, 2, 3, "own"] for g in (0, 1)]
    assert records[6]["error"] == "empty_prompt: field 'prompt' is empty"
    assert all(1 <= len(r["token_ids"]) <= 5 for r in records if "error" not in r)


def test_generate_reuses_an_engine_and_refuses_bad_keys(model_dir):
    engine = pagefleet.Engine(model_dir, pagefleet.EngineConfig(max_seq_len=64, max_pages=16))
    (greedy,) = pagefleet.generate(engine, [[5, 6, 7]], max_new_tokens=3)
    assert greedy["finish_reason"] in ("stop", "length") and greedy["batch_id"] is None
    assert pagefleet.generate(engine, [[5, 6, 7]], max_new_tokens=3) == [greedy]  # greedy: the same tokens again
    with pytest.raises(ValueError, match="unknown sampling key.*max_tokens"):
        pagefleet.generate(engine, ["hi"], max_tokens=3)
    with pytest.raises(ValueError, match="sampling.temperature"):
        pagefleet.generate(engine, ["hi"], temperature=-1)


def test_load_config_applies_overrides_as_strictly_as_the_command_line(tmp_path):
    yaml = tmp_path / "run.yaml"
    yaml.write_text("name: x\nsampling: {n: 2, seed: 4}\ncluster: {mesh: {model: 2}}\n")
    cfg = pagefleet.load_config(yaml, sampling={"max_new_tokens": 8}, **{"engine.max_seqs": 4, "cluster.mesh": {"model": 1}})
    assert isinstance(cfg, RunConfig)
    assert (cfg.name, cfg.sampling.n, cfg.sampling.seed, cfg.sampling.max_new_tokens) == ("x", 2, 4, 8)
    assert (cfg.engine.max_seqs, cfg.engine.max_seqs_in_prefill, cfg.cluster.mesh) == (4, 4, {"model": 1})
    assert pagefleet.load_config(cfg) == cfg
    assert pagefleet.load_config({"name": "y"}, **{"sampling.n": 3}).sampling.n == 3
    with pytest.raises(ConfigError, match=r"^sampling: The fields bogus are not valid"):
        pagefleet.load_config(None, sampling={"bogus": 1})
    with pytest.raises(ConfigError, match=r"run.yaml: cluster.mesh: expected dict\[str, int\], got '1'"):
        pagefleet.load_config(yaml, **{"cluster.mesh": 1})
    with pytest.raises(ConfigError, match="sampling.n must be at least 1"):
        pagefleet.load_config(yaml, **{"sampling.n": 0})


def test_import_is_cheap_and_versioned():
    import subprocess
    import sys

    code = "import sys, pagefleet; print(pagefleet.__version__); print('jax' in sys.modules, 'ray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[0] and out[1:] == ["False", "False"]


@pytest.mark.ray
def test_run_plans_and_runs_like_the_command(tmp_path):
    import yaml

    from engine.models.presets import write_model as write
    from orchestrator import exit_codes
    from tests.orchestrator.conftest import run_args, write_run_corpus

    model = str(write("tiny-llama", tmp_path / "model"))
    corpus = write_run_corpus(tmp_path / "corpus.jsonl", 12)
    overrides = {}
    for arg in run_args(model, corpus, tmp_path / "run", "--cluster.num_slices=1"):
        key, value = arg[2:].split("=", 1)
        overrides[key] = yaml.safe_load(value)
    outcome = pagefleet.run({"name": "api"}, **overrides)
    assert outcome.exit_code == exit_codes.OK
    assert outcome.summary["samples_done"] == 12 and outcome.summary["batches_failed"] == 0
    again = pagefleet.run({"name": "api"}, **overrides)  # planned and done: nothing to compute
    assert again.exit_code == exit_codes.OK
    with pytest.raises(PlanMismatch) as refused:  # other samples into the same run directory: the fix in Python terms
        pagefleet.run({"name": "api"}, **{**overrides, "sampling.max_new_tokens": 3})
    assert "pass a new name=NAME (or run_dir=DIR)" in str(refused.value) and "--" not in str(refused.value)


def test_rows_carry_their_own_sampling_settings(model_dir):
    """Item 12: a row's `sampling` object overrides the call's settings for its samples alone (the same samples as
    the call made with those settings), and a bad one is an error record naming the key."""
    engine = pagefleet.Engine(model_dir, pagefleet.EngineConfig(max_seq_len=128, max_pages=32, max_seqs=4))
    ids = [5, 6, 7, 8]
    hot = {"temperature": 0.9, "seed": 4, "top_k": 20, "min_p": 0.05, "max_new_tokens": 6}
    rows = [{"id": "short", "prompt_token_ids": ids, "sampling": {"max_new_tokens": 2}},
            {"id": "hot", "prompt_token_ids": ids, "sampling": hot},
            {"id": "plain", "prompt_token_ids": ids},
            {"id": "n", "prompt_token_ids": ids, "sampling": {"n": 3}},
            {"id": "type", "prompt_token_ids": ids, "sampling": {"temperature": "warm"}},
            {"id": "range", "prompt_token_ids": ids, "sampling": {"top_p": 0}},
            {"id": "list", "prompt_token_ids": ids, "sampling": [1]},
            {"id": "long", "prompt_token_ids": ids, "sampling": {"max_new_tokens": 200}}]
    records = {r["prompt_id"]: r for r in pagefleet.generate(engine, rows, max_new_tokens=9)}
    assert len(records["short"]["token_ids"]) <= 2 and len(records["plain"]["token_ids"]) <= 9
    alone = pagefleet.generate(engine, [{"id": "hot", "prompt_token_ids": ids}], **hot)[0]
    assert records["hot"]["token_ids"] == alone["token_ids"] and records["hot"]["sampling"] == hot
    assert records["n"]["error"] == ("bad_sampling: field 'sampling': key 'n' cannot be set per row "
                                      "(a prompt's sample count is the run's sampling.n)")
    assert records["type"]["error"] == "bad_sampling: field 'sampling': temperature is a str, not a number"
    assert records["range"]["error"] == "bad_sampling: field 'sampling': sampling.top_p must be in (0, 1], got 0"
    assert records["list"]["error"].startswith("bad_sampling: field 'sampling' is a list, not an object")
    assert records["long"]["error"].startswith("too_long: prompt has 4 tokens; with sampling.max_new_tokens=200")
