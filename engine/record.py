"""The sample record: the one definition of a sample. The Arrow schema of outputs and exports, the JSON lines
of `pagefleet generate` and the W&B samples table are all derived from `SampleRecord`. No JAX here."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields


@dataclass(frozen=True)
class SampleRecord:
    """One sample. `error` is set (and the sample fields empty) when the request could not run; it is not
    part of the stored record."""

    prompt_id: str
    generation_index: int
    """0 .. n - 1: which of the prompt's samples."""
    completion: str
    """The completion text, stop string excluded."""
    token_ids: list[int]
    """Generated token ids, up to and including the one that finished the sample."""
    logprobs: list[float] | None
    """The chosen tokens' log-probabilities (sampling.logprobs), else None."""
    finish_reason: str | None
    """`stop` (EOS or a stop string) | `length` (max_new_tokens); None with an error."""
    num_prompt_tokens: int
    """Tokens the sample was generated from; a scored row's context tokens."""
    batch_id: str | None = None
    """The batch that produced it (a run); None for `pagefleet generate` and the Python API."""
    passthrough: str | None = None
    """The input row's columns other than its id, plus `prompt_id` holding the id as the input typed it (an
    integer stays an integer), as a JSON object's text; None when the input kept nothing. `prompt_id` above is
    the id as a string (it seeds the sample and keys it); `output_record` spreads this object into the record."""
    continuation_logprobs: list[float] | None = None
    """A scored row (one with a continuation): each continuation token's logprob given the context and the
    continuation tokens before it; None for a sampled row. A scored row has no completion: `completion` is empty,
    `token_ids` holds the continuation's ids and `finish_reason` is None."""
    continuation_logprob: float | None = None
    """A scored row: the sum of `continuation_logprobs` (in float64), the continuation's log-likelihood."""
    is_greedy: bool | None = None
    """A scored row: every continuation token was the model's argmax (ties to the lowest id) at its position."""
    prompt_logprobs: list[dict] | None = None
    """sampling.prompt_logprobs = K: for every prompt token after the first (of a scored row: of context and
    continuation), `{"token_id", "logprob", "top": [{"token_id", "logprob"}, ...]}`, the K most likely tokens at
    its position, most likely first; else None."""
    error: str | None = None

    def to_json(self) -> dict:
        """The JSON record a user reads (`output_record`), and `error` when set."""
        record = output_record({name: getattr(self, name) for name in RECORD_FIELDS})
        if self.error is not None:
            record["error"] = self.error
        return record


RECORD_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(SampleRecord) if f.name != "error")
"""The stored record's fields, in order."""

RESERVED_COLUMNS: frozenset[str] = frozenset(RECORD_FIELDS) | {"error"}
"""Names an input column cannot have: a passed-through column is a field of the output record (`prompt_id` is
the input's id column itself, so it is not passed through under its own name)."""


def output_record(record: dict) -> dict:
    """The record as users read it (`pagefleet generate`, export, the API, the service): the stored fields
    without `passthrough`, whose object is spread in: `prompt_id` takes the id as typed in the input, and the
    input's other columns follow the record's fields (their names are never RESERVED_COLUMNS)."""
    out = {name: value for name, value in record.items() if name != "passthrough"}
    if record.get("passthrough"):
        out.update(json.loads(record["passthrough"]))
    return out

_ARROW_TYPES = {"prompt_id": "string", "generation_index": "int32", "completion": "string",
                "token_ids": "list<int32>", "logprobs": "list<float32>", "finish_reason": "string",
                "num_prompt_tokens": "int32", "batch_id": "string", "passthrough": "string",
                "continuation_logprobs": "list<float32>", "continuation_logprob": "float64", "is_greedy": "bool",
                "prompt_logprobs": "prompt_logprobs"}
assert tuple(_ARROW_TYPES) == RECORD_FIELDS, "every stored field needs an Arrow type"


def arrow_fields() -> list:
    """pyarrow fields of the stored record, in RECORD_FIELDS order."""
    import pyarrow as pa

    scalar = {"string": pa.string(), "int32": pa.int32(), "float32": pa.float32(), "float64": pa.float64(),
              "bool": pa.bool_()}
    top = pa.struct([("token_id", pa.int32()), ("logprob", pa.float32())])
    scalar["prompt_logprobs"] = pa.list_(pa.struct([("token_id", pa.int32()), ("logprob", pa.float32()),
                                                    ("top", pa.list_(top))]))

    def arrow_type(name: str):
        return pa.list_(scalar[name[5:-1]]) if name.startswith("list<") else scalar[name]

    return [pa.field(name, arrow_type(_ARROW_TYPES[name])) for name in RECORD_FIELDS]
