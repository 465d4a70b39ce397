"""A gs:// checkpoint on the Cloud Storage emulator: copied once per host, loaded exactly as a local one."""

import os

import numpy as np
import pytest

from orchestrator.plan.model_cache import local_copy
from tests.gcs_emulator import assert_loaded_alike, upload


def test_local_path_is_used_as_is(tmp_path):
    fetch = local_copy(str(tmp_path))
    assert (fetch.local_path, fetch.bytes_read) == (str(tmp_path), 0)


def test_copy_once_then_from_the_cache_and_again_when_the_bucket_changes(gcs_bucket, run_model, tmp_path):
    url = upload(run_model, f"{gcs_bucket}/models/tiny")
    files = sorted(os.listdir(run_model))
    size = sum(os.path.getsize(os.path.join(run_model, f)) for f in files)
    first = local_copy(url, str(tmp_path / "cache"))
    assert not first.cached and first.bytes_read == size
    for f in files:
        with open(os.path.join(run_model, f), "rb") as a, open(os.path.join(first.local_path, f), "rb") as b:
            assert a.read() == b.read(), f
    second = local_copy(url + "/", str(tmp_path / "cache"))
    assert second.cached and second.bytes_read == 0 and second.local_path == first.local_path
    # The checkpoint replaced in the bucket (a new generation of config.json): copied again.
    upload(os.path.join(run_model, "config.json"), f"{url}/config.json")
    third = local_copy(url, str(tmp_path / "cache"))
    assert not third.cached and third.bytes_read == size and third.local_path == first.local_path
    assert not [n for n in os.listdir(tmp_path / "cache") if n.startswith(".")]  # no temporaries left


def test_tokenizer_copy_takes_only_the_tokenizer_files(gcs_bucket, run_model, tmp_path):
    from orchestrator.plan.model_source import ModelSourceConfig, load_tokenizer

    url = upload(run_model, f"{gcs_bucket}/models/tiny")
    cache = str(tmp_path / "cache")
    remote = load_tokenizer(ModelSourceConfig(path=url, cache_dir=cache))
    local = load_tokenizer(ModelSourceConfig(path=run_model))
    text = "the quick brown fox"
    assert remote(text)["input_ids"] == local(text)["input_ids"]
    [copy] = [d for d in os.listdir(cache)]
    assert not any(n.endswith(".safetensors") for n in os.listdir(os.path.join(cache, copy)))


def test_missing_url_is_named(gcs_bucket, tmp_path):
    with pytest.raises(FileNotFoundError, match=f"{gcs_bucket}/nothing holds no files"):
        local_copy(f"{gcs_bucket}/nothing", str(tmp_path))


def test_sharded_load_from_the_bucket_equals_the_local_load(gcs_bucket, run_model, tmp_path):
    """Over a 2-way model mesh: every device holds exactly the shard it holds when loading the local checkpoint."""
    import jax
    from jax.sharding import Mesh

    from engine.models.weights import load_transformer

    url = upload(run_model, f"{gcs_bucket}/models/tiny")
    mesh = Mesh(np.array(jax.devices()[:2]).reshape(1, 2), ("data", "model"))
    remote = load_transformer(local_copy(url, str(tmp_path / "cache")).local_path, mesh=mesh)
    local = load_transformer(run_model, mesh=mesh)
    assert_loaded_alike(remote, local)


def test_the_cache_directory_does_not_tie_the_plan():
    """model.cache_dir says where a copy goes, not what is sampled: a resume with another one is the same plan."""
    from orchestrator.config import load_run_config

    a = load_run_config(None, ["--model.path=gs://b/m", "--model.cache_dir=/tmp/a"]).sample_affecting()
    b = load_run_config(None, ["--model.path=gs://b/m", "--model.cache_dir=/tmp/b"]).sample_affecting()
    assert a == b and "cache_dir" not in a["model"]
