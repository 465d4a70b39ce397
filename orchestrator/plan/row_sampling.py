"""Per-row sampling settings: a corpus row (or a `pagefleet generate` line) may carry a `sampling` object
(`corpus.sampling_field`) whose keys override the run's `sampling.*` for that row's samples alone:

    {"id": 7, "prompt": "...", "sampling": {"max_new_tokens": 64, "temperature": 0.7, "stop_token_ids": [13]}}

Keys: ROW_KEYS (every `sampling.*` key but `n`: a prompt's sample count is the run's); a row's structured output
(json_schema, regex, choice, grammar) replaces the run's. Values are typed as the
config keys are; a bad object rejects its row (`bad_sampling`) with one line naming the key, never repaired. The
validated overrides travel as canonical JSON (batch files, `overrides_json`) and are applied with `apply`.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from engine import SamplingConfig
from orchestrator.plan.rejection import Rejection, a_type

ROW_KEYS = ("max_new_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
            "frequency_penalty", "stop", "stop_token_ids", "min_tokens", "ignore_eos", "seed", "logprobs",
            "json_schema", "regex", "choice", "grammar")
"""The `sampling.*` keys a row may set for itself."""

STRUCTURED = ("json_schema", "regex", "choice", "grammar")
"""The keys of a structured output (one at most): a row that sets one replaces the run's."""

_INTS = ("max_new_tokens", "top_k", "min_tokens", "seed")
_FLOATS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")


def _type_error(key: str, value: Any) -> str | None:
    def is_int(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    if key in _INTS and not is_int(value):
        return f"{key} is {a_type(value)}, not an integer"
    if key in _FLOATS and not (is_int(value) or isinstance(value, float)):
        return f"{key} is {a_type(value)}, not a number"
    if key == "stop" and not (isinstance(value, list) and all(isinstance(s, str) for s in value)):
        return "stop must be a list of strings"
    if key == "stop_token_ids" and not (isinstance(value, list) and all(is_int(t) for t in value)):
        return "stop_token_ids must be a list of integers"
    if key in ("logprobs", "ignore_eos") and not isinstance(value, bool):
        return f"{key} is {a_type(value)}, not a boolean"
    if key == "json_schema" and not isinstance(value, (dict, bool)):
        return f"json_schema is {a_type(value)}, not a JSON Schema object"
    if key in ("regex", "grammar") and not isinstance(value, str):
        return f"{key} is {a_type(value)}, not a string"
    if key == "choice" and not (isinstance(value, list) and all(isinstance(s, str) for s in value)):
        return "choice must be a list of strings"
    return None


def row_overrides(value: Any, base: SamplingConfig, field: str) -> dict | Rejection:
    """The row's validated overrides (`{}` when it sets none), or why they cannot be used: a `bad_sampling`
    Rejection naming the field and key."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        return Rejection("bad_sampling", f"field {field!r} is {a_type(value)}, not an object of sampling keys")
    for key, item in value.items():
        if key not in ROW_KEYS:
            why = ("cannot be set per row (a prompt's sample count is the run's sampling.n)" if key == "n"
                   else f"is not a per-row sampling key (one of {', '.join(ROW_KEYS)})")
            return Rejection("bad_sampling", f"field {field!r}: key {key!r} {why}")
        if (why := _type_error(key, item)) is not None:
            return Rejection("bad_sampling", f"field {field!r}: {why}")
    try:
        apply(base, value)
    except ValueError as err:
        return Rejection("bad_sampling", f"field {field!r}: {err}")
    return dict(value)


def overrides_json(overrides: dict) -> str | None:
    """Canonical JSON text of validated overrides (None for none): what a batch file's `sampling` holds."""
    return json.dumps(overrides, sort_keys=True, ensure_ascii=False) if overrides else None


def apply(base: SamplingConfig, overrides: str | dict | None) -> SamplingConfig:
    """`base` with a row's overrides (`overrides_json` text or the dict) applied."""
    if not overrides:
        return base
    own = json.loads(overrides) if isinstance(overrides, str) else overrides
    if any(k in own for k in STRUCTURED):  # the row's structured output replaces the run's
        own = {**{k: None for k in STRUCTURED}, **own}
    return dataclasses.replace(base, **own)


def max_new_tokens(prompts, base: SamplingConfig):
    """i64[prompts]: each prompt's max_new_tokens in a batch table (its `sampling` column; the run's where a row
    sets none, or the plan is older than the column)."""
    import numpy as np

    own = prompts.column("sampling").to_pylist() if "sampling" in prompts.column_names else [None] * prompts.num_rows
    return np.array([apply(base, o).max_new_tokens for o in own], dtype=np.int64)
