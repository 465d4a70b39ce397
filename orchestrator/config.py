"""The run configuration: the components' own configs composed in one frozen dataclass.

Loaded with draccus from a YAML file plus `--a.b=value` overrides; strict (an unknown key is an
error). `sample_affecting` is the part a plan is tied to: change any of it and the existing
batches no longer describe the same samples.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import draccus
import yaml

from engine import EngineConfig, SamplingConfig
from orchestrator.config_errors import KEYS_DOC, ConfigError
from orchestrator.config_types import check_config_types
from orchestrator.observe.tracking import TrackerConfig
from orchestrator.plan.corpus import CorpusConfig
from orchestrator.plan.model_source import ModelSourceConfig
from orchestrator.plan.packing import PackingConfig
from orchestrator.run.retry import RetryConfig
from orchestrator.slices.cluster import ClusterConfig, engines_per_slice
from orchestrator.surface import overrides_hint

# Engine keys a plan is tied to: which prompts fit the context, and the KV page accounting.
PLAN_ENGINE_KEYS = ("page_size", "max_seq_len")
# Capacities: how much one batch (and the engine) holds at once. Samples do not depend on them, so a run may be
# resumed with others (e.g. on other hardware); pending batches are re-packed when they no longer fit.
# engine.kv_groups and host_kv_pages (which decides the groups with a host pool) change the pages a prompt needs.
CAPACITY_ENGINE_KEYS = ("max_pages", "max_seqs", "max_seqs_in_prefill", "max_prefill_size", "kv_groups",
                        "host_kv_pages")
# Keys that never change the samples (corpus.window_* shape the batches of a new plan, not what a resume reads).
NOT_SAMPLE_AFFECTING = ("corpus.shard_bytes", "corpus.in_process_bytes", "corpus.window_rows",
                        "corpus.window_bytes", "model.cache_dir")


@dataclass(frozen=True)
class RunConfig:
    name: str = "pagefleet"
    """Run name; run_dir defaults to manifests/<name>."""
    run_dir: str | None = None
    """The run directory (plan, manifest, outputs), a local path or a gs:// URL; defaults to manifests/<name>."""
    lock_stale_s: float = 60.0
    """On a gs:// run_dir: a head's lock not refreshed for this many seconds is stale (its head is gone) and the next
    head takes it over; the holder refreshes it every lock_stale_s / 6 seconds (docs/storage.md)."""
    corpus: CorpusConfig = field(default_factory=CorpusConfig)
    """Where the prompts come from and which fields hold them."""
    model: ModelSourceConfig = field(default_factory=ModelSourceConfig)
    """The checkpoint and tokenizer (a local directory, an fsspec URL or a Hugging Face Hub id in the local cache)."""
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    """How each completion is sampled; every key here changes the samples."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """The engine's capacities and kernels on each slice; `pagefleet size` derives the capacities."""
    packing: PackingConfig = field(default_factory=PackingConfig)
    """How accepted prompts are packed into batches (changes the plan, never a sample's tokens)."""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    """The Ray cluster, the slices in it and how the head keeps them busy."""
    retry: RetryConfig = field(default_factory=RetryConfig)
    """How often a failed batch is retried, and how long the head waits between attempts."""
    tracker: TrackerConfig = field(default_factory=TrackerConfig)
    """Where run metrics go (Weights & Biases or nowhere)."""

    def __post_init__(self) -> None:
        if self.engine.kv_memory_gib is not None:
            raise ValueError("engine.kv_memory_gib sizes `pagefleet generate`'s engine from one machine's memory; a "
                             "run's capacities must be identical on every host: set engine.max_pages instead "
                             "(`pagefleet size` computes it for a chip)")

    @property
    def resolved_run_dir(self) -> str:
        return self.run_dir or os.path.join("manifests", self.name)

    @property
    def samples_in_flight_per_slice(self) -> int:
        """Unfinished samples the head keeps at each slice (cluster.samples_in_flight_per_slice, else twice the
        slots of its engines: the next batches wait in the engines' queues when slots free up)."""
        engines = engines_per_slice(self.cluster.mesh, self.cluster.hosts_per_slice)
        return self.cluster.samples_in_flight_per_slice or 2 * self.engine.max_seqs * engines

    def sample_affecting(self) -> dict[str, Any]:
        """The keys a plan is tied to, as plain data (corpus, model source, sampling, the context and page size)."""
        sections = {"corpus": dataclasses.asdict(self.corpus), "model": dataclasses.asdict(self.model)}
        for key in NOT_SAMPLE_AFFECTING:
            section, name = key.split(".", 1)
            sections[section].pop(name, None)
        return {
            **sections,
            "sampling": dataclasses.asdict(self.sampling),
            "engine": {k: getattr(self.engine, k) for k in PLAN_ENGINE_KEYS},
        }

    def capacities(self) -> dict[str, Any]:
        """The per-batch budgets (engine capacities and packing), as plain data: retunable on resume."""
        return {"engine": {k: getattr(self.engine, k) for k in CAPACITY_ENGINE_KEYS},
                "packing": dataclasses.asdict(self.packing)}


# draccus' message for a value of the wrong shape: the value, then (after the field) the expected type.
_FAILED_PARSE = re.compile(r"Failed when parsing value='(?P<value>.*?)' into field .* of type (?P<type>.*?)\.\n", re.S)


def load_run_config(config_path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Load a YAML run config and apply draccus overrides (`--sampling.n=4`); every failure is a one-line
    ConfigError naming the file or key."""
    if config_path is not None:
        check_yaml(config_path)
    check_config_types(RunConfig, config_path, overrides)  # strict: a value of the wrong type is never converted
    try:
        return draccus.parse(RunConfig, config_path=config_path, args=list(overrides), exit_on_error=False)
    except argparse.ArgumentError as e:  # `--sampling.n` with no value, and the like
        near = did_you_mean(re.findall(r"--([\w.]+)", str(e)))
        raise ConfigError(f"{e}{near}; {overrides_hint()} (keys in {KEYS_DOC})") from None
    except Exception as e:  # noqa: BLE001 - draccus' and the components' errors, made one line
        raise config_error(e, config_path) from None


def check_yaml(config_path: str | Path) -> None:
    """Refuse a missing file, invalid YAML (with its line and column) and a top level that is not a mapping."""
    path = Path(config_path)
    if not path.is_file():
        raise ConfigError(f"config file {str(config_path)!r} not found")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ConfigError(f"{config_path}: invalid YAML{where}: {e.problem or e.context}") from None
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ConfigError(f"{config_path}: invalid YAML: {' '.join(str(e).split())}") from None
    if data is not None and not isinstance(data, dict):
        raise ConfigError(f"{config_path}: a run config is a mapping of keys (see {KEYS_DOC}), "
                          f"not a YAML {type(data).__name__}")


def config_error(e: Exception, source: str | Path | None) -> ConfigError:
    """One line for an error raised while decoding a config from `source` (a file, or None for overrides)."""
    where = f"{source}: " if source is not None else ""
    if isinstance(e, draccus.utils.DecodingError):
        key = ".".join(e.key_path)
        parsed = _FAILED_PARSE.search(e.message)
        if parsed:  # draccus' two-line "Failed when parsing ... Underlying error is ..."
            expected = re.sub(r"<class '(?:\w+\.)*(\w+)'>", r"\1", parsed["type"])
            message = f"expected {expected}, got {parsed['value']!r}"
        else:
            message = re.sub(r" \(<class '\w+'>\)", "", " ".join(e.message.replace("`", "").split()))
            unknown = _UNKNOWN_FIELDS.search(message)
            if unknown:  # a misspelt key: name the nearest real one
                message += did_you_mean([f"{key}.{f}" if key else f for f in re.split(r",\s*", unknown["fields"])])
        return ConfigError(f"{where}{key + ': ' if key else ''}{message} (keys in {KEYS_DOC})")
    cause = e.__cause__ or e.__context__
    if isinstance(e, draccus.utils.DraccusException) and isinstance(cause, ValueError):
        return ConfigError(str(cause))  # a component's own validation, which names the key
    if isinstance(e, draccus.utils.DraccusException):  # `unrecognized arguments: --sampling.max_new_token=3`
        near = did_you_mean(re.findall(r"--([\w.]+)", str(e)))
        return ConfigError(f"{' '.join(str(e).split())}{near}; {overrides_hint()} (keys in {KEYS_DOC})")
    if isinstance(e, (ValueError, TypeError)):
        return ConfigError(f"{where}{e}")
    raise e


# draccus' message for keys a section does not have.
_UNKNOWN_FIELDS = re.compile(r"The fields (?P<fields>.+?) are not valid for")


def known_keys() -> list[str]:
    """Every dotted key of the run config (`sampling`, `sampling.max_new_tokens`, ...), walked from the defaults."""
    def walk(obj: Any, prefix: str) -> list[str]:
        out = []
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            out.append(f"{prefix}{f.name}")  # a section's name too: `smpling` -> `sampling`
            out += walk(value, f"{prefix}{f.name}.") if dataclasses.is_dataclass(value) else []
        return out

    return walk(RunConfig(), "")


def did_you_mean(keys: list[str]) -> str:
    """' (did you mean X?)' for the first of `keys` (dotted) that is close to a real key; '' when none is."""
    known = known_keys()
    for key in keys:
        near = difflib.get_close_matches(key, known, n=1, cutoff=0.75)
        if near and near[0] != key:
            return f" (did you mean {near[0]}?)"
    return ""


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value and not key == "mesh":
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def plan_changes(planned: dict[str, Any], cfg: RunConfig) -> list[str]:
    """'key: old -> new' for each sample-affecting key of `cfg` that differs from a plan's `sample_affecting`
    (run.json). Plans written before capacities were retunable hold them there too; they are not compared."""
    old = {section: dict(values) for section, values in planned.items()}
    old.pop("packing", None)
    for section, values in RunConfig().sample_affecting().items():  # keys newer than the plan: their defaults
        for key, value in values.items():  # (each new key's default samples what the code did before it)
            old.setdefault(section, {}).setdefault(key, value)
    for key in CAPACITY_ENGINE_KEYS:
        old.get("engine", {}).pop(key, None)
    return diff_keys(old, cfg.sample_affecting())


def diff_keys(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """'key: old -> new' for every flattened key whose value differs."""
    a, b = flatten(old), flatten(new)
    return [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
