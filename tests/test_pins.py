"""The environment is the one pyproject.toml pins: the JAX stack exactly, and every exact pin installed as written."""

from __future__ import annotations

import tomllib
from importlib.metadata import version
from pathlib import Path

from packaging.requirements import Requirement

PYPROJECT = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]
REQUIREMENTS = [Requirement(r) for r in PROJECT["dependencies"] + PROJECT["optional-dependencies"]["dev"]]


def test_the_jax_stack_is_pinned_exactly():
    """jax, jaxlib and ml_dtypes (JAX's dtypes, imported by every process that imports JAX) at one version each:
    ml_dtypes 0.7.0, which `>=0.5` let in, takes ~0.55 s to import against 0.6.0's ~5 ms."""
    pins = {r.name: str(r.specifier) for r in REQUIREMENTS}
    for name in ("jax", "jaxlib", "ml_dtypes"):
        assert pins.get(name, "").startswith("=="), f"{name} is not pinned exactly in pyproject.toml: {pins.get(name)!r}"


def test_every_exact_pin_is_the_version_installed():
    """A virtualenv made before a pin changed says so here (`make` reinstalls when pyproject.toml is newer)."""
    wrong = [f"{r.name} {version(r.name)} (pyproject.toml: {r.specifier})" for r in REQUIREMENTS
             if str(r.specifier).startswith("==") and (r.marker is None or r.marker.evaluate())
             and not r.specifier.contains(version(r.name), prereleases=True)]
    assert not wrong, "installed versions differ from the pins: " + "; ".join(wrong)
