"""Where a model comes from: a local directory, or a Hugging Face Hub id resolved from the local Hub cache."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from orchestrator.plan.model_source import ModelSourceConfig, load_tokenizer, model_fingerprint, resolve_model

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def hub_cache(root, repo_id: str, model_dir: str):
    """The layout huggingface_hub writes: models--org--name/{refs/main, snapshots/<commit>/..., blobs/}."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    (repo / "blobs").mkdir()
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    for f in sorted(p for p in Path(model_dir).iterdir() if p.is_file()):
        blob = repo / "blobs" / f"blob-{f.name}"
        shutil.copy(f, blob)
        (snapshot / f.name).symlink_to(blob)
    return snapshot


def test_a_hub_id_resolves_from_the_local_cache_offline(tiny_model, tmp_path, monkeypatch):
    snapshot = hub_cache(tmp_path / "hub", "org/tiny", tiny_model)
    monkeypatch.delenv("HF_HOME", raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_model("org/tiny") == str(snapshot)
    source = ModelSourceConfig(path="org/tiny")
    assert source.require_path() == source.tokenizer_path == str(snapshot)
    assert model_fingerprint(source) == model_fingerprint(ModelSourceConfig(path=tiny_model))
    assert load_tokenizer(source)("hello world")["input_ids"]

    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path))  # HF_HOME/hub is the cache when HF_HUB_CACHE is unset
    assert resolve_model("org/tiny") == str(snapshot)


def test_an_uncached_id_or_a_missing_directory_is_one_line_naming_it(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    with pytest.raises(FileNotFoundError) as e:
        ModelSourceConfig(path="org/absent").require_path()
    message = str(e.value)
    assert "\n" not in message and message.startswith("model.path 'org/absent' is not a local directory")
    assert "not in the local Hub cache" in message and str(tmp_path / "empty-hub") in message
    with pytest.raises(FileNotFoundError, match=r"^model.path '/no/such/model' does not exist"):
        ModelSourceConfig(path="/no/such/model").require_path()
    with pytest.raises(FileNotFoundError, match=r"^model.path '.*' has no config.json"):
        ModelSourceConfig(path=str(tmp_path)).require_path()
    with pytest.raises(FileNotFoundError, match=r"^model.tokenizer 'org/tok' is not a local directory"):
        ModelSourceConfig(path=tiny_model, tokenizer="org/tok").tokenizer_path  # noqa: B018
    assert resolve_model(tiny_model) == tiny_model  # a local directory is used as is, never looked up


def test_a_typo_in_a_local_path_is_not_sent_to_the_hub(tmp_path, monkeypatch):
    (tmp_path / "models" / "tiny-llama").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    with pytest.raises(FileNotFoundError) as e:  # `models/tiny-lama` reads as a Hub id too: the directory is meant
        ModelSourceConfig(path="models/tiny-lama").require_path()
    assert str(e.value) == ("model.path 'models/tiny-lama' does not exist: models has no directory 'tiny-lama'; "
                            "did you mean 'models/tiny-llama'?")
    with pytest.raises(FileNotFoundError, match=r"init-model --preset tiny-llama --output models/qwen`$"):
        ModelSourceConfig(path="models/qwen").require_path()
