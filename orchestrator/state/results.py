"""What crosses the head/slice boundary, as plain data: work in (`BatchWork`), results out (`Completed | Failed`).

Results are values, never exceptions thrown across Ray: a slice that cannot run a batch says so with
`Failed(error=...)`, and the head decides whether to retry.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pyarrow as pa

from engine import arrow_fields

# outputs/<id>.parquet and `pagefleet export`: the engine's SampleRecord, plus `row` (the prompt's corpus
# row, which orders the export).
SAMPLE_SCHEMA = pa.schema([*arrow_fields(), ("row", pa.int64())])


def conform(table: pa.Table) -> pa.Table:
    """A samples table as SAMPLE_SCHEMA: outputs written before a field existed (`passthrough`) get it as nulls."""
    for name in SAMPLE_SCHEMA.names:
        if name not in table.column_names:
            table = table.append_column(SAMPLE_SCHEMA.field(name), pa.nulls(table.num_rows, SAMPLE_SCHEMA.field(name).type))
    return table.select(SAMPLE_SCHEMA.names).cast(SAMPLE_SCHEMA)
STATS_KEY = b"pagefleet.batch_stats"  # parquet metadata: the batch's BatchStats as JSON


@dataclass(frozen=True)
class BatchWork:
    """One batch for a slice: a reference to batches/<id>.parquet, which the slice reads itself (the head never
    holds token ids), and the head's flow control."""

    batch_id: str
    attempt: int
    path: str
    """batches/<id>.parquet: a local path every host of the slice sees, or a gs:// URL."""
    num_prompts: int
    seq: int = 0
    """Position in the order the head sent batches to this slice (hosts feed them in this order)."""
    wake_at: int | None = None
    """The head's flow control: return its pending poll once this many of the samples sent to this slice (or
    host) have finished, since it then has room to send the next batch. None: never early."""
    num_samples: int | None = None
    """The samples the batch gives (BatchRecord.samples); None: num_prompts * sampling.n."""


@dataclass(frozen=True)
class BatchStats:
    """What a slice measured while the batch was in its engine."""

    num_samples: int
    num_output_tokens: int
    duration_s: float
    """From the batch's first request entering the engine to its last sample finishing."""
    num_steps: int
    """Engine steps taken while the batch had sequences in the engine."""
    occupancy: float
    """Mean live sequences per step over those steps, as a fraction of engine.max_seqs."""
    max_pages_in_use: int

    def to_json(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


@dataclass(frozen=True)
class Completed:
    batch_id: str
    attempt: int
    slice: str
    samples: pa.Table  # SAMPLE_SCHEMA, batch order then generation_index
    stats: BatchStats
    timeline: list[dict] = field(default_factory=list)
    """The slice's steps since its previous result, in 1 s buckets: {t (epoch s), steps, tokens_per_s, occupancy,
    device_s and host_s (the engine loop's time in device calls and in host work between them)}."""


@dataclass(frozen=True)
class Failed:
    batch_id: str
    attempt: int
    slice: str
    error: str
    timeline: list[dict] = field(default_factory=list)
    deterministic: bool = False
    """The batch fails the same way on every attempt (a prompt the engine refuses, non-finite logits): the head
    marks it failed at once instead of retrying it."""


Result = Completed | Failed


def with_stats(table: pa.Table, stats: BatchStats) -> pa.Table:
    """The samples table carrying its batch's stats in the parquet metadata (read back on resume)."""
    return table.replace_schema_metadata({STATS_KEY: json.dumps(stats.to_json()).encode()})


def stats_of(schema: pa.Schema) -> BatchStats | None:
    raw = (schema.metadata or {}).get(STATS_KEY)
    return None if raw is None else BatchStats(**json.loads(raw))
