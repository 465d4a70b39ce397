"""`pagefleet export RUN_DIR --output FILE`: every sample in corpus order, then generation index."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from orchestrator.atomic import atomic_write
from orchestrator.manifest import read_manifest
from orchestrator.results import SAMPLE_SCHEMA
from orchestrator.rundir import RunDir

RECORD_FIELDS = ["prompt_id", "generation_index", "completion", "token_ids", "logprobs", "finish_reason",
                 "num_prompt_tokens", "batch_id"]


def collect(run_dir_path: str | Path, partial: bool = False) -> pa.Table:
    """The done batches' samples, sorted by corpus row then generation index (SAMPLE_SCHEMA)."""
    run_dir = RunDir(Path(run_dir_path))
    if not run_dir.manifest.exists():
        raise FileNotFoundError(f"{run_dir.manifest} not found: {run_dir.root} is not a run directory")
    records = read_manifest(run_dir.manifest)
    not_done = [r.batch_id for r in records if r.status != "done"]
    if not_done and not partial:
        raise ValueError(f"{len(not_done)} of {len(records)} batches are not done (first: {not_done[0]}); finish the "
                         "run with `pagefleet run CONFIG`, or pass --partial to export what is done")
    tables = [pq.read_table(run_dir.root / r.output).cast(SAMPLE_SCHEMA) for r in records if r.status == "done"]
    table = pa.concat_tables(tables) if tables else SAMPLE_SCHEMA.empty_table()
    order = pc.sort_indices(table, sort_keys=[("row", "ascending"), ("generation_index", "ascending")])
    return table.take(order)


def export(run_dir_path: str | Path, output: str | Path, partial: bool = False) -> int:
    """Write the samples to `output` (.jsonl or .parquet, atomically); returns how many."""
    output = Path(output)
    if output.suffix not in (".jsonl", ".parquet"):
        raise ValueError(f"--output must end in .jsonl or .parquet, got {output.name!r}")
    table = collect(run_dir_path, partial).select(RECORD_FIELDS)
    output.parent.mkdir(parents=True, exist_ok=True)
    if output.suffix == ".parquet":
        atomic_write(output, lambda tmp: pq.write_table(table, tmp))
    else:
        def write(tmp: str) -> None:
            with open(tmp, "w", encoding="utf-8") as f:
                for batch in table.to_batches(max_chunksize=4096):
                    for row in batch.to_pylist():
                        f.write(json.dumps(row, ensure_ascii=False) + "\n")

        atomic_write(output, write)
    return table.num_rows
