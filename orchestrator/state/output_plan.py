"""Which plan an output file belongs to: outputs/<id>.parquet carries its plan fingerprint and prompt ids.

An output is adopted on start (its batch becomes done without recomputing it) only when it was computed for
this plan and this batch. The head stamps both into the file's parquet metadata when it writes it:

- `pagefleet.plan`: the plan fingerprint, sha256 over run.json's `fingerprints` (config, corpus, tokenizer,
  model; see planner.fingerprints), so a file from another config, seed, corpus, tokenizer or model differs;
- `pagefleet.prompt_ids`: sha256 over the batch's prompt ids in batch order (batches/<id>.parquet).

Outputs written before these keys existed carry neither. In a run directory whose run.json matches the config
they are adopted when their own `prompt_id` and `generation_index` columns are exactly the batch's prompts x n;
when planning afresh into a directory (no run.json), an output that cannot prove its plan is foreign.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from orchestrator.storage import parquet_io

PLAN_KEY = b"pagefleet.plan"
PROMPT_IDS_KEY = b"pagefleet.prompt_ids"


def plan_fingerprint(fingerprints: dict[str, str]) -> str:
    """One digest for run.json's fingerprints (config, corpus, tokenizer, model)."""
    return hashlib.sha256(json.dumps(fingerprints, sort_keys=True).encode()).hexdigest()


def prompt_ids_digest(prompt_ids: list[str]) -> str:
    """sha256 over the prompt ids in order (JSON, so no separator can be forged inside an id)."""
    return hashlib.sha256(json.dumps(prompt_ids).encode()).hexdigest()


def stamp(samples: pa.Table, plan: str, prompt_ids: list[str]) -> pa.Table:
    """`samples` with the plan fingerprint and the batch's prompt ids digest added to its metadata."""
    metadata = dict(samples.schema.metadata or {})
    metadata[PLAN_KEY] = plan.encode()
    metadata[PROMPT_IDS_KEY] = prompt_ids_digest(prompt_ids).encode()
    return samples.replace_schema_metadata(metadata)


def stamped_plan(metadata: dict[bytes, bytes] | None) -> str | None:
    """The plan fingerprint an output's schema metadata records (None for outputs older than the stamp)."""
    raw = (metadata or {}).get(PLAN_KEY)
    return None if raw is None else raw.decode()


def belongs(output: Path, meta: pq.FileMetaData, plan: str, batch_file: Path, n: int) -> str | None:
    """Why `output` is not the samples of this plan's batch (None when it is)."""
    metadata = meta.schema.to_arrow_schema().metadata or {}
    recorded = stamped_plan(metadata)
    if recorded is not None and recorded != plan:
        return "it was computed for another plan (config, corpus, tokenizer or model)"
    prompt_ids = parquet_io.read_parquet(batch_file, columns=["prompt_id"]).column("prompt_id").to_pylist()
    if recorded is not None:
        if metadata.get(PROMPT_IDS_KEY, b"").decode() != prompt_ids_digest(prompt_ids):
            return "its prompt ids are not this batch's"
        return None
    columns = parquet_io.read_parquet(output, columns=["prompt_id", "generation_index"])  # an output older than the stamp
    if (columns.column("prompt_id").to_pylist() != [p for p in prompt_ids for _ in range(n)]
            or columns.column("generation_index").to_pylist() != list(range(n)) * len(prompt_ids)):
        return "its samples are not this batch's prompts"
    return None


def first_foreign(outputs: Path, plan: str) -> Path | None:
    """The first output file in `outputs` (sorted) not stamped with `plan`, unreadable or older ones included."""
    if not outputs.is_dir():
        return None
    for path in sorted(outputs.glob("*.parquet")):
        try:
            recorded = stamped_plan(parquet_io.read_parquet_schema(path).metadata)
        except Exception:  # noqa: BLE001 - an unreadable file cannot prove its plan either
            recorded = None
        if recorded != plan:
            return path
    return None
