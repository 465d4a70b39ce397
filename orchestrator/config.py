"""The run configuration: the components' own configs composed in one frozen dataclass.

Loaded with draccus from a YAML file plus `--a.b=value` overrides; strict (an unknown key is an
error). `sample_affecting` is the part a plan is tied to: change any of it and the existing
batches no longer describe the same samples.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import draccus

from engine import EngineConfig, SamplingConfig
from orchestrator.cluster import ClusterConfig
from orchestrator.corpus import CorpusConfig
from orchestrator.model_source import ModelSourceConfig
from orchestrator.packing import PackingConfig
from orchestrator.retry import RetryConfig
from orchestrator.tracking import TrackerConfig

# Engine keys that change how prompts are packed or validated (the rest do not change the plan).
PLAN_ENGINE_KEYS = ("page_size", "max_pages", "max_seqs", "max_seqs_in_prefill", "max_prefill_size", "max_seq_len")
# Keys that never change the samples or the plan.
NOT_SAMPLE_AFFECTING = ("corpus.shard_bytes",)


@dataclass(frozen=True)
class RunConfig:
    name: str = "pagefleet"
    """Run name; run_dir defaults to manifests/<name>."""
    run_dir: str | None = None
    """The run directory (plan, manifest, outputs); defaults to manifests/<name>."""
    corpus: CorpusConfig = field(default_factory=CorpusConfig)
    model: ModelSourceConfig = field(default_factory=ModelSourceConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    packing: PackingConfig = field(default_factory=PackingConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    retry: RetryConfig = field(default_factory=RetryConfig)
    tracker: TrackerConfig = field(default_factory=TrackerConfig)

    @property
    def resolved_run_dir(self) -> str:
        return self.run_dir or os.path.join("manifests", self.name)

    @property
    def samples_in_flight_per_slice(self) -> int:
        """Unfinished samples the head keeps at each slice (cluster.samples_in_flight_per_slice, else twice the
        engine's slots: the next batches wait in the engine's queue when slots free up)."""
        return self.cluster.samples_in_flight_per_slice or 2 * self.engine.max_seqs

    def sample_affecting(self) -> dict[str, Any]:
        """The keys a plan is tied to, as plain data (corpus, model source, sampling, packing)."""
        corpus = dataclasses.asdict(self.corpus)
        for key in NOT_SAMPLE_AFFECTING:
            corpus.pop(key.split(".", 1)[1], None)
        return {
            "corpus": corpus,
            "model": dataclasses.asdict(self.model),
            "sampling": dataclasses.asdict(self.sampling),
            "engine": {k: getattr(self.engine, k) for k in PLAN_ENGINE_KEYS},
            "packing": dataclasses.asdict(self.packing),
        }


class ConfigError(ValueError):
    """A config that cannot load; the message names the key and the fix."""


def load_run_config(config_path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Load a YAML run config and apply draccus overrides (`--sampling.n=4`)."""
    if config_path is not None and not Path(config_path).is_file():
        raise ConfigError(f"config file {str(config_path)!r} not found")
    try:
        return draccus.parse(RunConfig, config_path=config_path, args=list(overrides), exit_on_error=False)
    except draccus.utils.DecodingError as e:
        raise ConfigError(f"{config_path}: {e} (see DESIGN.md section 3 for the keys)") from None
    except draccus.utils.DraccusException as e:
        cause = e.__cause__ or e.__context__
        if isinstance(cause, ValueError):  # a component's own validation, which names the key
            raise ConfigError(str(cause)) from None
        raise ConfigError(f"{e}; overrides are --section.key=value with the keys of DESIGN.md section 3") from None
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{config_path}: {e}") from None


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value and not key == "mesh":
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def diff_keys(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """'key: old -> new' for every flattened key whose value differs."""
    a, b = flatten(old), flatten(new)
    return [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
