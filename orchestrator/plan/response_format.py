"""A row's OpenAI-style `response_format` (`corpus.response_format_field`, a `pagefleet generate` line's
`response_format`) as the sampling keys of a structured output:

    {"type": "json_schema", "json_schema": {"name": "...", "schema": {...}}}  ->  sampling.json_schema = {...}
    {"type": "json_object"}                                                   ->  sampling.json_schema = {"type": "object"}
    {"type": "text"}                                                          ->  no constraint

Anything else rejects the row (`bad_response_format`) with one line naming the field; whether the schema compiles
is checked with the tokenizer (`invalid_grammar`, engine.structured_error).
"""

from __future__ import annotations

from typing import Any

from engine import SamplingConfig
from orchestrator.plan.rejection import Rejection, a_type
from orchestrator.plan.row_sampling import STRUCTURED, apply

TYPES = ("json_schema", "json_object", "text")
"""The `response_format` types pagefleet reads (OpenAI's)."""


def response_format_keys(value: Any, field: str) -> dict | Rejection:
    """The sampling keys `value` (a row's response_format, None for none) sets, or why it cannot be read."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        return Rejection("bad_response_format", f"field {field!r} is {a_type(value)}, not an object with a type")
    kind = value.get("type")
    if kind not in TYPES:
        return Rejection("bad_response_format", f"field {field!r}: type {kind!r} is not one of {', '.join(TYPES)}")
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_schema": {"type": "object"}}
    spec = value.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(schema, dict):
        return Rejection("bad_response_format", f"field {field!r}: type json_schema needs json_schema.schema, "
                                                f"a JSON Schema object")
    return {"json_schema": schema}


def with_response_format(overrides: dict, value: Any, field: str, base: SamplingConfig) -> dict | Rejection:
    """A row's validated sampling overrides with its response_format's keys added (one structured output at
    most: a row that also sets one in its sampling object is rejected, naming both)."""
    keys = response_format_keys(value, field)
    if isinstance(keys, Rejection) or not keys:
        return keys if isinstance(keys, Rejection) else overrides
    merged = {**overrides, **keys}
    if any(k in overrides for k in STRUCTURED):
        key = next(k for k in STRUCTURED if k in overrides)
        return Rejection("bad_response_format", f"field {field!r} and the row's sampling.{key} both set a "
                                                "structured output; keep one")
    try:
        apply(base, merged)
    except ValueError as err:
        return Rejection("bad_response_format", f"field {field!r}: {err}")
    return merged
