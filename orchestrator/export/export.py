"""`pagefleet export RUN_DIR --output FILE`: every sample in corpus order, then generation index, as JSON lines or
Parquet, with each input's passthrough columns expanded. The sort that puts a run's samples in corpus order within a
memory budget is sort.py's."""

from __future__ import annotations

import json
import sys
from array import array
import tempfile
from collections.abc import Callable, Iterator
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from engine import RECORD_FIELDS as ENGINE_RECORD_FIELDS, output_record
from orchestrator.export.openai_output import COLUMNS, BatchHeader, batch_lines
from orchestrator.export.sort import (DEFAULT_MEMORY_BYTES, Log, iter_sorted, metadata, read_samples,
                                      remove_stale_export_temporaries, temporary_prefix)
from orchestrator.json_out import dumps
from orchestrator.state.manifest import read_manifest
from orchestrator.state.manifest_check import check_manifest
from orchestrator.state.results import SAMPLE_SCHEMA
from orchestrator.state.rundir import RunDir
from orchestrator.storage import location, storage
from orchestrator.storage.atomic import atomic_write

RECORD_FIELDS = list(ENGINE_RECORD_FIELDS)  # the stored record: the engine's SampleRecord
OWN_FIELDS = [f for f in RECORD_FIELDS if f != "passthrough"]  # an exported record's own fields, before the input's
_JSONL_ROWS = 4096  # samples converted to Python objects at a time


@dataclass(frozen=True)
class DoneOutputs:
    """The samples files of a run's done batches, in manifest order, with each file's samples and uncompressed bytes:
    its footer read once (the export command read every footer two to four times), and never held: ~46 KB in memory
    each (SAMPLE_SCHEMA's columns), ~46 GB at a million batches."""

    paths: list[Path]
    rows: np.ndarray
    nbytes: np.ndarray

    @property
    def samples(self) -> int:
        return int(self.rows.sum())

    @property
    def totals(self) -> tuple[int, int]:
        """(uncompressed bytes, samples): what the sort sizes itself by (iter_sorted)."""
        return int(self.nbytes.sum()), self.samples


def done_outputs(run_dir_path: str | Path, partial: bool = False) -> DoneOutputs:
    """The output files of the run's done batches, in manifest order; refuses an unfinished run unless
    `partial`, and names any done batch whose output is missing."""
    run_dir = RunDir(location.location(run_dir_path))  # local or gs://
    if not run_dir.manifest.exists():
        raise FileNotFoundError(f"{run_dir.manifest} not found: {run_dir.root} is not a run directory")
    records = read_manifest(run_dir.manifest)
    check_manifest(run_dir, records)  # against the plan: each batch once, its own output, every prompt counted
    not_done = [r.batch_id for r in records if r.status != "done"]
    if not_done and not partial:
        raise ValueError(f"{len(not_done)} of {len(records)} batches are not done (first: {not_done[0]}); finish the "
                         "run with `pagefleet run CONFIG`, or pass --partial to export what is done")
    n = _samples_per_prompt(run_dir)
    paths, rows, nbytes = [], array("q"), array("q")
    for r in records:
        if r.status != "done":
            continue
        path = run_dir.root / (r.output or f"outputs/{r.batch_id}.parquet")
        if not path.exists():
            raise FileNotFoundError(f"batch {r.batch_id} is done in {run_dir.manifest} but its samples file {path} "
                                    "is missing; restore it, or set the batch back to pending and resume the run")
        meta = metadata(path)
        if n is not None and meta.num_rows != r.samples(n):
            raise ValueError(f"batch {r.batch_id} is done in {run_dir.manifest} with {r.num_prompts} prompts and "
                             f"{r.samples(n)} samples, but {path} holds {meta.num_rows} samples; rerun `pagefleet run` "
                             "with the run's config to check and repair the run directory")
        paths.append(path)
        rows.append(meta.num_rows)
        nbytes.append(sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups)))
    return DoneOutputs(paths, np.frombuffer(rows, np.int64), np.frombuffer(nbytes, np.int64))


def _samples_per_prompt(run_dir: RunDir) -> int | None:
    """sampling.n of the plan (run.json), or None where run.json does not say."""
    if not run_dir.run_json.exists():
        return None
    n = run_dir.read_run_json()["sample_affecting"].get("sampling", {}).get("n")
    return n if isinstance(n, int) else None


def collect(run_dir_path: str | Path, partial: bool = False, memory_bytes: int = DEFAULT_MEMORY_BYTES) -> pa.Table:
    """All the done batches' samples in one table, in corpus order (for callers that want them in memory)."""
    done = done_outputs(run_dir_path, partial)
    with closing(iter_sorted(done.paths, done.totals, None, memory_bytes)) as tables:
        parts = list(tables)
    return pa.concat_tables(parts) if parts else SAMPLE_SCHEMA.empty_table()


def page(done: DoneOutputs, tmp_dir: str | Path | None, offset: int, limit: int,
         memory_bytes: int = DEFAULT_MEMORY_BYTES) -> tuple[int, list[dict]]:
    """(how many samples there are, the records of `limit` of them from `offset` in corpus order)."""
    total = done.samples
    rows: list[dict] = []
    if offset >= total or limit <= 0:
        return total, rows
    seen = 0  # samples before the current table
    with closing(iter_sorted(done.paths, done.totals, tmp_dir, memory_bytes)) as tables:
        for table in tables:
            start = max(offset - seen, 0)
            if start < table.num_rows:
                rows += [output_record(r) for r in table.slice(start, limit - len(rows)).select(RECORD_FIELDS).to_pylist()]
            seen += table.num_rows
            if len(rows) >= limit:
                break
    return total, rows


FORMATS = (".jsonl", ".parquet")
"""The output file extensions export writes."""

LAYOUTS = ("records", "openai_batch")
"""What export writes (--format): sample records (docs/records.md), or OpenAI Batch output lines (openai_output.py)."""


def check_output(output: str | Path, layout: str = "records") -> None:
    """Refuse an output whose extension (or --format) export cannot write (before any work is done)."""
    if layout not in LAYOUTS:
        raise ValueError(f"--format must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    if Path(output).suffix not in FORMATS:
        raise ValueError(f"--output must end in .jsonl or .parquet, got {Path(output).name!r}")
    if layout == "openai_batch" and Path(output).suffix != ".jsonl":
        raise ValueError(f"--format openai_batch writes JSON lines: --output must end in .jsonl, got "
                         f"{Path(output).name!r}")


def export(run_dir_path: str | Path, output: str | Path, partial: bool = False,
           memory_bytes: int = DEFAULT_MEMORY_BYTES, log: Log | None = None,
           on_rows: Callable[[int], None] | None = None, layout: str = "records", done: DoneOutputs | None = None
           ) -> int:
    """Write the samples to `output` (.jsonl or .parquet, atomically; local or gs://); returns how many. `layout`
    `openai_batch` writes a run of an OpenAI Batch file as Batch output lines instead (openai_output.py). `done`: the
    run's done_outputs when the caller has them already."""
    check_output(output, layout)
    done = done_outputs(run_dir_path, partial) if done is None else done
    header = BatchHeader(RunDir(location.location(run_dir_path))) if layout == "openai_batch" else None
    if not storage.is_url(output):
        return _export(done, Path(output), memory_bytes, log, on_rows, header)
    # Written locally, then uploaded as one whole object: atomic on an object store, as a rename is locally.
    with tempfile.TemporaryDirectory(prefix=temporary_prefix()) as tmp:
        local = Path(tmp) / str(output).rstrip("/").rsplit("/", 1)[-1]
        count = _export(done, local, memory_bytes, log, on_rows, header)
        storage.upload_file(str(local), str(output))
    return count


def _export(done: DoneOutputs, output: Path, memory_bytes: int, log: Log | None,
            on_rows: Callable[[int], None] | None, header: BatchHeader | None = None) -> int:
    output.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_export_temporaries(output)
    written = 0

    def records(fields: list[str] = RECORD_FIELDS) -> Iterator[pa.Table]:
        nonlocal written
        for table in iter_sorted(done.paths, done.totals, output.parent, memory_bytes, log):
            yield table.select(fields)
            written += table.num_rows
            if on_rows:
                on_rows(table.num_rows)

    def write(tmp: str) -> None:
        if output.suffix == ".parquet":
            columns = passthrough_schema(done.paths)
            with pq.ParquetWriter(tmp, exported_schema(columns)) as writer:
                for table in records():
                    writer.write_table(expand_passthrough(table, columns))
            return
        with open(tmp, "w", encoding="utf-8") as f:
            if header is not None:
                f.writelines(line + "\n" for line in batch_lines(records(COLUMNS), header))
                return
            for table in records():
                for batch in table.to_batches(max_chunksize=_JSONL_ROWS):
                    f.writelines(dumps(output_record(row), ensure_ascii=False) + "\n" for row in batch.to_pylist())

    atomic_write(output, write)
    return written


# -- passed-through input columns in a parquet export ---------------------------------------------

def passthrough_schema(paths: list[Path]) -> pa.Schema:
    """The Arrow types of the passed-through input columns (SampleRecord.passthrough) over every output file, in
    first-seen order; `prompt_id` among them when ids were typed. A column whose values have no common type
    (an id that is an integer in one row and a string in another) raises ValueError naming it: JSON lines keep
    each value as the input had it."""
    schemas: dict[pa.Schema, None] = {}  # the distinct ones, in first-seen order: a million files share a few
    for path in paths:
        column = read_samples(path, "passthrough")
        if column is None:  # an output older than passed-through columns
            continue
        values = [json.loads(t) for t in column["passthrough"].to_pylist() if t]
        if values:
            schemas.setdefault(_inferred(values, path))
    try:
        return pa.unify_schemas(list(schemas), promote_options="permissive") if schemas else pa.schema([])
    except (pa.ArrowInvalid, pa.ArrowTypeError) as err:
        raise ValueError(f"the input columns passed through to the samples have no common type across rows ({err}); "
                         "export to .jsonl instead, which keeps each value as the input had it") from None


def _inferred(values: list[dict], path: Path) -> pa.Schema:
    try:
        return pa.Table.from_pylist(values).schema
    except (pa.ArrowInvalid, pa.ArrowTypeError) as err:
        raise ValueError(f"the input columns passed through to the samples of {path.name} have no common type "
                         f"across rows ({err}); export to .jsonl instead, which keeps each value as the input had it"
                         ) from None


def exported_schema(columns: pa.Schema) -> pa.Schema:
    """A parquet export's schema: the record's own fields (`prompt_id` typed as the input typed its ids), then the
    passed-through columns."""
    own = [columns.field("prompt_id") if f == "prompt_id" and "prompt_id" in columns.names else SAMPLE_SCHEMA.field(f)
           for f in OWN_FIELDS]
    return pa.schema(own + [f for f in columns if f.name != "prompt_id"])


def expand_passthrough(table: pa.Table, columns: pa.Schema) -> pa.Table:
    """`table` (RECORD_FIELDS) as `exported_schema(columns)`: the passthrough object spread into columns; a row
    without a typed id keeps its string id (a row number) cast to the ids' type."""
    out = table.select(OWN_FIELDS)
    values = [json.loads(t) if t else {} for t in table["passthrough"].to_pylist()]
    try:
        extra = pa.Table.from_pylist(values, schema=columns)
        if "prompt_id" in columns.names:
            field = columns.field("prompt_id")
            untyped = pc.if_else(pc.is_null(extra["prompt_id"]), out["prompt_id"], None)  # rows without an id
            out = out.set_column(0, field, pc.coalesce(extra["prompt_id"], untyped.cast(field.type)))
            extra = extra.drop_columns(["prompt_id"])
    except (pa.ArrowInvalid, pa.ArrowTypeError) as err:
        raise ValueError(f"the input columns passed through to the samples have no common type across rows ({err}); "
                         "export to .jsonl instead, which keeps each value as the input had it") from None
    for f in extra.schema:
        out = out.append_column(f, extra[f.name])
    return out


def print_progress(message: str) -> None:
    print(f"pagefleet export: {message}", file=sys.stderr, flush=True)
