"""The Python API: `generate`, `load_config` and `run`, over the same code as the `pagefleet` commands.

`generate` is `pagefleet generate` without files (the engine alone, one process, no Ray); `load_config` loads
a run config as strictly as `pagefleet run` does; `run` is `pagefleet run`. docs/python-api.md shows them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine import Engine, EngineConfig, SamplingConfig, structured_error
from orchestrator.config import ConfigError, RunConfig, check_yaml, config_error
from orchestrator.local.generate import parse_lines, sample_records, sized_engine
from orchestrator.plan.model_source import resolve_model
from orchestrator.run.driver import Driver
from orchestrator.surface import surface

if TYPE_CHECKING:
    from orchestrator.run.driver import RunOutcome

Prompt = str | Sequence[Mapping[str, str]] | Sequence[int] | Mapping[str, Any]
"""A text prompt, a chat (a list of {role, content}), prompt token ids, or a row as `pagefleet generate` reads
it ({"id", "prompt"} | {"id", "messages"} | {"id", "prompt_token_ids"}; with `continuation` or
`continuation_token_ids` it is scored, one record per continuation)."""


def _row(prompt: Prompt, index: int) -> Any:
    """The input row for one prompt; a row dict is passed on as is (judged like a `generate` input line)."""
    if isinstance(prompt, str):
        return {"id": index, "prompt": prompt}
    if isinstance(prompt, Mapping):
        return dict(prompt) if "id" in prompt else {"id": index, **prompt}
    items = list(prompt)
    if items and all(isinstance(t, int) and not isinstance(t, bool) for t in items):
        return {"id": index, "prompt_token_ids": items}
    if items and all(isinstance(m, Mapping) for m in items):
        return {"id": index, "messages": items}
    return {"id": index, "prompt": prompt}  # judged (and refused with a reason) like any other bad row


def generate(model: str | Engine, prompts: Sequence[Prompt], *, engine: Mapping[str, Any] | None = None,
             dtype: str = "float32", **sampling: Any) -> list[dict]:
    """Sample completions for `prompts`; returns one sample record (docs/records.md) per (prompt,
    generation_index) in input order, `prompt_id` being the prompt's index (or a row's own `id`).

    `model`: a checkpoint directory, a Hub id in the local Hub cache, or an `Engine` (reused: no reload).
    `engine`: engine keys (`{"max_seqs": 8}`, the `engine.*` keys of docs/config.md), for a new engine only;
    the capacities not given are sized for this machine, as `pagefleet generate` sizes them.
    `sampling`: the `sampling.*` keys (`max_new_tokens=32, temperature=0.7, n=2, seed=1, stop=["\\n"]`), structured
    outputs included (`json_schema={...}`, `regex=...`, `choice=[...]`, `grammar=...`; a row dict may carry its own
    `response_format`).
    A prompt that cannot run gives records with `error` set (as `pagefleet generate` writes them); a bad
    key raises ValueError naming it."""
    if isinstance(prompts, (str, bytes)):
        raise TypeError("prompts is a list of prompts; wrap a single prompt in a list")
    with surface("python"):
        return _generate(model, prompts, engine, dtype, sampling)


def _generate(model: str | Engine, prompts: Sequence[Prompt], engine: Mapping[str, Any] | None, dtype: str,
              sampling: dict[str, Any]) -> list[dict]:
    sampling_cfg = build_config(SamplingConfig, sampling, "sampling")
    lines = [(i + 1, _row(p, i)) for i, p in enumerate(prompts)]
    if isinstance(model, Engine):
        if engine is not None:
            raise ValueError("engine keys configure a new engine; this Engine is already built")
        eng = model
        parsed = parse_lines(lines, eng.tokenizer, eng.model_config.vocab_size, sampling_cfg)
    else:
        path, given = resolve_model(str(model), "model"), dict(engine or {})
        # Sized for this machine and these prompts as `pagefleet generate` sizes its engine; the keys given are kept.
        eng, parsed = sized_engine(path, build_config(EngineConfig, given, "engine"), dtype, frozenset(given), lines,
                                   sampling_cfg)
    if sampling_cfg.structured is not None:  # the call's structured output applies to every prompt: refused at once
        why = ("the model has no tokenizer" if eng.tokenizer is None
               else structured_error(eng.tokenizer, eng.vocab_size, sampling_cfg))
        if why is not None:
            raise ValueError(why)
    return sample_records(eng, parsed, sampling_cfg)


def build_config(cls: type, values: Mapping[str, Any], section: str) -> Any:
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ValueError(f"unknown {section} key(s) {', '.join(unknown)}; the keys are {', '.join(sorted(names))} "
                         "(docs/config.md)")
    return cls(**values)


def load_config(config: str | Path | RunConfig | Mapping[str, Any] | None = None, **overrides: Any) -> RunConfig:
    """A run config from a YAML file, a RunConfig or a mapping, with overrides applied, loaded as strictly
    as `pagefleet run` loads one (a bad key or value raises ConfigError, a ValueError, naming it).

    Overrides are keyword arguments: a section as a mapping (`sampling={"n": 2}`) or a dotted key
    (`**{"sampling.n": 2}`); nested values merge into the file's."""
    with surface("python"):
        return _load_config(config, overrides)


def _load_config(config: str | Path | RunConfig | Mapping[str, Any] | None, overrides: dict[str, Any]) -> RunConfig:
    import draccus
    import yaml

    source: str | None = None
    if config is None:
        base: dict[str, Any] = {}
    elif isinstance(config, RunConfig):
        base = dataclasses.asdict(config)
    elif isinstance(config, Mapping):
        base = _copy(config)
    else:
        check_yaml(config)
        source = str(config)
        base = yaml.safe_load(Path(config).read_text(encoding="utf-8")) or {}
    for key, value in overrides.items():
        _merge(base, key.split("."), value)
    try:
        return draccus.decode(RunConfig, base)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - draccus' and the components' errors, made one line
        raise config_error(e, source) from None


def _copy(tree: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _copy(v) if isinstance(v, Mapping) else v for k, v in tree.items()}


def _merge(tree: dict[str, Any], path: list[str], value: Any) -> None:
    """Set `value` at `path`; a mapping merges into a mapping already there (except cluster.mesh and the like,
    which a mapping replaces: they are values, not sections)."""
    head, rest = path[0], path[1:]
    if rest:
        _merge(tree.setdefault(head, {}), rest, value)
    elif isinstance(value, Mapping) and isinstance(tree.get(head), dict) and head in _SECTIONS:
        for k, v in value.items():
            _merge(tree[head], k.split("."), v)
    else:
        tree[head] = _copy(value) if isinstance(value, Mapping) else value


_SECTIONS = ("corpus", "model", "sampling", "engine", "packing", "cluster", "retry", "tracker")
"""The run config's sections (mappings of keys); any other mapping value is one key's value."""


def run(config: str | Path | RunConfig | Mapping[str, Any], *, progress: bool = False, **overrides: Any) -> RunOutcome:
    """`pagefleet run`: plan the run directory if needed, then run every batch that is not done (on the Ray
    cluster in RAY_ADDRESS, else a local one started in this process); resumes a stopped run. Returns the
    outcome: `exit_code` (orchestrator/exit_codes.py) and `summary` (the figures `pagefleet run` prints).
    `config` and `overrides` as for `load_config`."""
    cfg = load_config(config, **overrides)
    with surface("python"):
        return Driver(cfg, show_progress=progress).run()
