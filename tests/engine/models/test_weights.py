"""engine/models/weights.py: a checkpoint index may name only shard files inside its model directory (issue 41 item 5)."""

import json, pytest
from engine.models.checkpoint_check import CheckpointError
from engine.models.weights import SafetensorsCheckpoint

@pytest.mark.parametrize("name", ["/etc/passwd", "../../outside/model.safetensors", "sub/../../x.safetensors"])
def test_an_index_naming_a_shard_outside_the_model_directory_is_refused(tmp_path, name):
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": name}}))
    with pytest.raises(CheckpointError, match="not inside the model directory"):
        SafetensorsCheckpoint(tmp_path)
