"""pagefleet for notebooks and scripts: a thin API over `engine/` and `orchestrator/`.

    import pagefleet

    records = pagefleet.generate("models/tiny-llama", ["Hello", "Write a poem"], max_new_tokens=32)
    engine = pagefleet.Engine("models/tiny-llama")               # the engine itself, one process
    cfg = pagefleet.load_config("configs/demo.yaml", sampling={"n": 2})
    outcome = pagefleet.run(cfg)                                   # what `pagefleet run` does

Importing this package is cheap; JAX, transformers and Ray load on first use. docs/python-api.md
describes each function.
"""

from __future__ import annotations

from importlib import metadata
from typing import TYPE_CHECKING, Any

try:
    __version__ = metadata.version("pagefleet")
except metadata.PackageNotFoundError:  # a checkout on PYTHONPATH, never installed
    __version__ = "0+unknown"

__all__ = ["Engine", "EngineConfig", "RunConfig", "SamplingConfig", "generate", "load_config", "resolve_model", "run",
           "__version__"]

if TYPE_CHECKING:
    from engine import Engine, EngineConfig, SamplingConfig
    from orchestrator.config import RunConfig
    from orchestrator.plan.model_source import resolve_model
    from pagefleet.api import generate, load_config, run

_LAZY = {"Engine": ("engine", "Engine"), "EngineConfig": ("engine", "EngineConfig"),
         "SamplingConfig": ("engine", "SamplingConfig"), "RunConfig": ("orchestrator.config", "RunConfig"),
         "generate": ("pagefleet.api", "generate"),
         "load_config": ("pagefleet.api", "load_config"), "run": ("pagefleet.api", "run"),
         "resolve_model": ("orchestrator.plan.model_source", "resolve_model")}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'pagefleet' has no attribute {name!r}")
    import importlib

    module, attr = _LAZY[name]
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value
    return value
