"""The weight files' identity (run.json `weights`): what each check catches, and what it costs nothing to pass."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from orchestrator.plan.weights_identity import WeightsChanged, check_weights, weights_digest, weights_identity
from orchestrator.state.rundir import PlanMismatch


@pytest.fixture
def model(run_model, tmp_path) -> Path:
    return Path(shutil.copytree(run_model, tmp_path / "model"))


def flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))  # same size, same header


def test_an_unchanged_checkpoint_passes_and_a_copy_has_the_same_digest(model, tmp_path):
    recorded = weights_identity(str(model))
    assert set(recorded) == {"model.safetensors"} and "sha256" in recorded["model.safetensors"]
    check_weights(str(model), recorded)
    copy = Path(shutil.copytree(model, tmp_path / "copy"))  # new modification times, same bytes
    assert weights_digest(weights_identity(str(copy))) == weights_digest(recorded)


def test_a_same_size_same_header_edit_is_refused_naming_the_file(model):
    recorded = weights_identity(str(model))
    flip_last_byte(model / "model.safetensors")
    with pytest.raises(WeightsChanged, match=r"model\.safetensors changed .*same size and header, different content"):
        check_weights(str(model), recorded)
    assert issubclass(WeightsChanged, PlanMismatch)  # the CLI's exit status 2, one line


def test_a_touched_file_is_rehashed_and_accepted(model):
    recorded = weights_identity(str(model))
    path = model / "model.safetensors"
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    check_weights(str(model), recorded)


def test_a_large_checkpoint_is_not_hashed_and_a_rewrite_is_refused(model):
    recorded = weights_identity(str(model), content_limit_bytes=0)
    assert "sha256" not in recorded["model.safetensors"]
    path = model / "model.safetensors"
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    with pytest.raises(WeightsChanged, match="rewritten since the run was planned .* too large to re-hash"):
        check_weights(str(model), recorded)


def test_size_header_and_file_set_changes_are_refused(model):
    recorded = weights_identity(str(model))
    path = model / "model.safetensors"
    original = path.read_bytes()
    path.write_bytes(original + b"\0")
    with pytest.raises(WeightsChanged, match="bytes then"):
        check_weights(str(model), recorded)
    path.write_bytes(original[:8] + original[8:60].replace(b'"pt"', b'"qt"', 1) + original[60:])  # same length
    with pytest.raises(WeightsChanged, match="header differs"):
        check_weights(str(model), recorded)
    path.write_bytes(original)
    (model / "extra.safetensors").write_bytes(original)
    with pytest.raises(WeightsChanged, match="extra.safetensors is new"):
        check_weights(str(model), recorded)
