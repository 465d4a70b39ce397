"""engine/models/weights.py: what a checkpoint may name, and how a corrupt tensor is reported."""

import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from engine.models.checkpoint_check import CheckpointError
from engine.models.weights import SafetensorsCheckpoint


@pytest.mark.parametrize("name", ["/etc/passwd", "../../outside/model.safetensors", "sub/../../x.safetensors"])
def test_an_index_naming_a_shard_outside_the_model_directory_is_refused(tmp_path, name):
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": name}}))
    with pytest.raises(CheckpointError, match="not inside the model directory"):
        SafetensorsCheckpoint(tmp_path)


def test_a_nan_weight_is_located_in_the_tensor_as_stored_not_in_the_part_read(tmp_path):
    """A device reads a transposed view ([in, out] from torch's [out, in]); the index the error gives must be the
    file's, where a user would look (it was printed transposed)."""
    w = np.zeros((3, 5), np.float32)
    w[1, 4] = np.nan
    save_file({"w": w}, str(tmp_path / "model.safetensors"))
    checkpoint = SafetensorsCheckpoint(tmp_path)
    with pytest.raises(CheckpointError, match=r"tensor w \[3, 5\] holds 1 NaN or Inf values \(first at index \[1, 4\]\)"):
        checkpoint.read("w", lambda t: t.T)
