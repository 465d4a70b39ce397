"""The structured-output keys of a sample (`sampling.json_schema`, `regex`, `choice`, `grammar`) as one plain,
hashable constraint (`spec_of`). No llguidance here: engine/sampling/structured.py compiles what this names."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

KINDS = ("json_schema", "regex", "choice", "grammar")
"""The sampling keys that constrain a sample, one at most."""

Spec = tuple[str, str]
"""(kind, text): a constraint as plain, hashable data; the text of a JSON Schema or a choice list is canonical
JSON, so that equal schemas share one compiled grammar."""


def spec_of(json_schema: Any = None, regex: str | None = None, choice: Sequence[str] | None = None,
            grammar: str | None = None) -> Spec | None:
    """The constraint the sampling keys set, or None; a ValueError (one line naming the key) when more than one
    is set or a value has the wrong type."""
    given = [k for k, v in zip(KINDS, (json_schema, regex, choice, grammar)) if v is not None]
    if len(given) > 1:
        raise ValueError(f"sampling.{given[0]} and sampling.{given[1]} are both set; a sample takes one structured "
                         f"output at most ({', '.join('sampling.' + k for k in KINDS)})")
    if not given:
        return None
    if json_schema is not None:
        if isinstance(json_schema, str):
            try:
                json_schema = json.loads(json_schema)
            except json.JSONDecodeError as err:
                raise ValueError(f"sampling.json_schema is not JSON: {err}") from None
        if not isinstance(json_schema, (dict, bool)):
            raise ValueError(f"sampling.json_schema must be a JSON Schema object, got {type(json_schema).__name__}")
        return "json_schema", json.dumps(json_schema, sort_keys=True, ensure_ascii=False)
    if choice is not None:
        if (isinstance(choice, str) or not all(isinstance(c, str) for c in choice) or not choice):
            raise ValueError("sampling.choice must be a non-empty list of strings")
        return "choice", json.dumps(list(choice), ensure_ascii=False)
    kind, text = ("regex", regex) if regex is not None else ("grammar", grammar)
    if not isinstance(text, str):
        raise ValueError(f"sampling.{kind} must be a string, got {type(text).__name__}")
    return kind, text
