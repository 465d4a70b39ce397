"""docs/config.md is generated from the config dataclasses' field docstrings, and must be current."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from orchestrator.config import RunConfig
from orchestrator.config_reference import MissingDocstring, keys, markdown
from orchestrator.local.generate import GenerateConfig

ROOT = Path(__file__).resolve().parents[2]


def test_docs_config_md_is_current():
    assert (ROOT / "docs" / "config.md").read_text(encoding="utf-8") == markdown(), (
        "docs/config.md is stale: run `python -m orchestrator.config_reference > docs/config.md`")


def test_every_key_has_a_docstring_and_appears_in_the_reference():
    text = markdown()
    for k in keys(RunConfig) + keys(GenerateConfig):
        assert k.doc and f"`{k.name}`" in text, k.name
    names = [k.name for k in keys(RunConfig)]
    assert {"sampling.max_new_tokens", "engine.max_seqs_in_prefill", "cluster.mesh", "tracker.mode"} <= set(names)


def test_a_field_without_a_docstring_is_an_error():
    @dataclass(frozen=True)
    class Undocumented:
        documented: int = 1
        """A documented field."""
        bare: str = "x"

    with pytest.raises(MissingDocstring, match="bare"):
        keys(Undocumented)
