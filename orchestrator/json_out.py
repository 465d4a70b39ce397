"""JSON that every reader can parse: no bare NaN or Infinity (Python's json writes them, and they are not JSON).

A non-finite float is written as null. Samples never hold one (the engine fails a sample whose logits are not
finite), so this is the last guard for what is written as JSON: generate's records and stats, export's JSON
lines, rejected.jsonl, the manifest, status and progress.
"""

from __future__ import annotations

import json
import math
from typing import Any


def dumps(obj: Any, **kwargs: Any) -> str:
    """`json.dumps(obj, **kwargs)` with every NaN or infinite float written as null."""
    try:
        return json.dumps(obj, allow_nan=False, **kwargs)
    except ValueError:  # rare: only then walk the object
        return json.dumps(finite(obj), allow_nan=False, **kwargs)


def finite(obj: Any) -> Any:
    """`obj` with every non-finite float replaced by None (dicts, lists and tuples walked)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [finite(v) for v in obj]
    return obj
