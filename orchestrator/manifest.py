"""The manifest, `batches.jsonl`: one record per batch, the resume point; the head is its only writer."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from orchestrator.atomic import atomic_write_text
from orchestrator.json_out import dumps

Status = Literal["pending", "running", "done", "failed"]


@dataclass(frozen=True)
class BatchRecord:
    batch_id: str
    status: Status = "pending"
    num_prompts: int = 0
    num_prompt_tokens: int = 0
    num_pages: int = 0
    """KV pages reserved for the batch (worst case, every sample at full length)."""
    attempts: int = 0
    error: str | None = None
    slice: str | None = None
    """Who ran it last."""
    started_at: float | None = None
    finished_at: float | None = None
    output: str | None = None
    """outputs/<id>.parquet relative to the run directory, once done."""
    num_samples: int = 0
    """Samples written (num_prompts * sampling.n once done)."""
    num_output_tokens: int = 0
    """Completion tokens over the batch's samples."""
    duration_s: float | None = None
    """Time in the slice's engine, first request in to last sample out."""
    occupancy: float | None = None
    """Mean live sequences per engine step while the batch ran, as a fraction of engine.max_seqs."""


def batch_id(index: int, num_batches: int) -> str:
    """Zero-padded so ids sort in batch order: b000000, b000001, ..."""
    return f"b{index:0{max(6, len(str(max(num_batches - 1, 0))))}d}"


def write_manifest(path: str | Path, records: list[BatchRecord], before_replace=None) -> None:
    """Replace the manifest atomically."""
    atomic_write_text(path, "".join(dumps(asdict(r)) + "\n" for r in records), before_replace=before_replace)


class CorruptRunFile(ValueError):
    """batches.jsonl or run.json cannot be read; the message names the file, the line and the recovery."""


RECOVER = ("remove it and rerun `pagefleet run` with the same config: the plan is rebuilt and the outputs "
           "already written are adopted")


def read_manifest(path: str | Path) -> list[BatchRecord]:
    """The records; raises CorruptRunFile naming the file and line of a record that does not parse."""
    records = []
    with open(path, "rb") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                records.append(BatchRecord(**json.loads(line)))
            except (ValueError, TypeError, RecursionError) as e:  # cut short, not JSON, or not a record's fields
                raise CorruptRunFile(f"{path} line {line_no} is corrupt ({type(e).__name__}: {e}); {RECOVER}") from None
    return records
