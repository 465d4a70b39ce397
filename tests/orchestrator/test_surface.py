"""orchestrator/surface.py: one fact, rendered as the caller sets it (command line, Python, HTTP body)."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.config import ConfigError
from orchestrator.plan.model_source import ModelSourceConfig
from orchestrator.service.service_runs import parse_run_config
from orchestrator.surface import setting, surface


def test_a_setting_is_named_as_each_surface_sets_it():
    assert (setting("name", "NAME"), setting("model.path", "DIR")) == ("--name=NAME", "--model.path=DIR")
    with surface("python"):
        assert (setting("name", "NAME"), setting("model.path", "DIR")) == ("name=NAME", 'model={"path": DIR}')
        with surface("http"):
            assert setting("model.path", "DIR") == '"model": {"path": DIR}'
        assert setting("name", "NAME") == "name=NAME"  # the inner surface ends with its block
    assert setting("name", "NAME") == "--name=NAME"


def test_errors_name_the_setting_for_their_caller(tmp_path: Path):
    with pytest.raises(ValueError, match=r"pass --model\.path=DIR"):
        ModelSourceConfig().require_path()
    with surface("python"), pytest.raises(ValueError, match=r'pass model=\{"path": DIR\}'):
        ModelSourceConfig().require_path()
    with pytest.raises(ConfigError) as http:  # the service: an HTTP answer names body keys, never flags
        parse_run_config(b"name: x\ncorpus: {path: c.jsonl}\n", tmp_path, 1 << 20)
    assert '"model": {"path": DIR}' in str(http.value) and "--model.path" not in str(http.value)
