"""`pagefleet export RUN_DIR --output FILE`: every sample in corpus order, then generation index.

Packing puts corpus rows into batches longest first, so corpus order needs a sort over every sample of
the run, and a 100M-prompt run's samples do not fit in memory. The sort keeps to a memory budget: when
the done batches fit in a third of it they are sorted in memory; otherwise they are read in order,
sorted in runs of at most a third of the budget, each run written to a temporary parquet file (in small
row groups), and the runs are merged. The merge holds one row group of each run and emits, round by
round, every buffered sample up to the smallest last key among the buffers: all of those are final,
since every run is sorted. Disk: the runs take about as much space as the run's outputs/, in a
temporary directory (beside the output file for `export`) that is removed at the end, also on errors.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import closing
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from engine import RECORD_FIELDS as ENGINE_RECORD_FIELDS, output_record
from orchestrator.storage import location, parquet_io, storage
from orchestrator.storage.atomic import atomic_write
from orchestrator.json_out import dumps
from orchestrator.run.manifest import read_manifest
from orchestrator.run.manifest_check import check_manifest
from orchestrator.run.results import SAMPLE_SCHEMA, conform
from orchestrator.run.rundir import RunDir

RECORD_FIELDS = list(ENGINE_RECORD_FIELDS)  # the stored record: the engine's SampleRecord
OWN_FIELDS = [f for f in RECORD_FIELDS if f != "passthrough"]  # an exported record's own fields, before the input's
DEFAULT_MEMORY_BYTES = 2 * 2**30
_SORT_KEYS = [("row", "ascending"), ("generation_index", "ascending")]
_JSONL_ROWS = 4096  # samples converted to Python objects at a time

Log = Callable[[str], None]


def done_outputs(run_dir_path: str | Path, partial: bool = False) -> list[Path]:
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
    paths = []
    for r in records:
        if r.status != "done":
            continue
        path = run_dir.root / (r.output or f"outputs/{r.batch_id}.parquet")
        if not path.exists():
            raise FileNotFoundError(f"batch {r.batch_id} is done in {run_dir.manifest} but its samples file {path} "
                                    "is missing; restore it, or set the batch back to pending and resume the run")
        if n is not None and (rows := metadata(path).num_rows) != r.num_prompts * n:
            raise ValueError(f"batch {r.batch_id} is done in {run_dir.manifest} with {r.num_prompts} prompts x {n} "
                             f"samples, but {path} holds {rows} samples; rerun `pagefleet run` with the run's config "
                             "to check and repair the run directory")
        paths.append(path)
    return paths


def _samples_per_prompt(run_dir: RunDir) -> int | None:
    """sampling.n of the plan (run.json), or None where run.json does not say."""
    if not run_dir.run_json.exists():
        return None
    n = run_dir.read_run_json()["sample_affecting"].get("sampling", {}).get("n")
    return n if isinstance(n, int) else None


def closing_source(path):
    """A context manager giving what pyarrow.parquet reads for `path` (local, or a ranged-read file on gs://)."""
    from contextlib import nullcontext

    source = parquet_io.parquet_source(path)
    return nullcontext(source) if source is path else source


def metadata(path: Path) -> pq.FileMetaData:
    """The samples file's parquet footer; a truncated or corrupt file raises ValueError naming it and the fix."""
    try:
        with closing_source(path) as source:
            return pq.read_metadata(source)
    except (pa.ArrowException, OSError) as err:
        raise ValueError(f"the samples file {path} is corrupt or truncated ({err}); rerun `pagefleet run` with the "
                         "run's config: it finds the file on start and recomputes that batch") from None


def count_samples(paths: list[Path]) -> int:
    return sum(metadata(p).num_rows for p in paths)


def iter_sorted(paths: list[Path], tmp_dir: str | Path | None, memory_bytes: int = DEFAULT_MEMORY_BYTES,
                log: Log | None = None) -> Iterator[pa.Table]:
    """The samples of these batch output files (SAMPLE_SCHEMA) as consecutive tables in corpus row, then
    generation index order, holding about `memory_bytes` at most; temporary runs go under `tmp_dir` (None:
    the system's temporary directory). Close the generator (or run it to the end) to remove them."""
    metas = [metadata(p) for p in paths]  # one read per file: at 100M prompts, ~1M files
    size = sum(m.row_group(i).total_byte_size for m in metas for i in range(m.num_row_groups))  # uncompressed
    run_bytes = max(1, memory_bytes // 3)  # a run in memory, its sort order and its sorted copy
    if size <= run_bytes:
        yield from _once_each(_sorted_in_memory(paths))
        return
    with tempfile.TemporaryDirectory(prefix=_temporary_prefix(), dir=tmp_dir) as tmp:
        runs = _write_sorted_runs(paths, Path(tmp), run_bytes, sum(m.num_rows for m in metas), log)
        if log:
            log(f"merging {len(runs)} sorted runs")
        yield from _once_each(_merge(runs))


def _once_each(tables: Iterator[pa.Table]) -> Iterator[pa.Table]:
    """`tables` (sorted by corpus row, then generation index), refusing a sample that appears twice: the last guard
    against an output file counted for two batches (duplicates sit next to each other in the sorted stream)."""
    last: tuple[int, int] | None = None
    for table in tables:
        if table.num_rows:
            rows, gens = table["row"].to_numpy(), table["generation_index"].to_numpy()
            same = np.flatnonzero((rows[1:] == rows[:-1]) & (gens[1:] == gens[:-1]))
            at = int(same[0]) + 1 if len(same) else (0 if last == (int(rows[0]), int(gens[0])) else None)
            if at is not None:
                raise ValueError(f"prompt {table['prompt_id'][at].as_py()!r} sample {int(gens[at])} is in two output "
                                 f"files (batch {table['batch_id'][at].as_py()} and another): the run directory's "
                                 "outputs do not match its plan; rerun `pagefleet run` with the run's config to check "
                                 "and repair it")
            last = (int(rows[-1]), int(gens[-1]))
        yield table


def collect(run_dir_path: str | Path, partial: bool = False, memory_bytes: int = DEFAULT_MEMORY_BYTES) -> pa.Table:
    """All the done batches' samples in one table, in corpus order (for callers that want them in memory)."""
    with closing(iter_sorted(done_outputs(run_dir_path, partial), None, memory_bytes)) as tables:
        parts = list(tables)
    return pa.concat_tables(parts) if parts else SAMPLE_SCHEMA.empty_table()


def page(paths: list[Path], tmp_dir: str | Path | None, offset: int, limit: int,
         memory_bytes: int = DEFAULT_MEMORY_BYTES) -> tuple[int, list[dict]]:
    """(how many samples there are, the records of `limit` of them from `offset` in corpus order)."""
    total = count_samples(paths)
    rows: list[dict] = []
    if offset >= total or limit <= 0:
        return total, rows
    seen = 0  # samples before the current table
    with closing(iter_sorted(paths, tmp_dir, memory_bytes)) as tables:
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


def check_output(output: str | Path) -> None:
    """Refuse an output whose extension export cannot write (before any work is done)."""
    if Path(output).suffix not in FORMATS:
        raise ValueError(f"--output must end in .jsonl or .parquet, got {Path(output).name!r}")


def export(run_dir_path: str | Path, output: str | Path, partial: bool = False,
           memory_bytes: int = DEFAULT_MEMORY_BYTES, log: Log | None = None,
           on_rows: Callable[[int], None] | None = None) -> int:
    """Write the samples to `output` (.jsonl or .parquet, atomically; local or gs://); returns how many."""
    check_output(output)
    paths = done_outputs(run_dir_path, partial)
    if not storage.is_url(output):
        return _export(paths, Path(output), memory_bytes, log, on_rows)
    # Written locally, then uploaded as one whole object: atomic on an object store, as a rename is locally.
    with tempfile.TemporaryDirectory(prefix=_temporary_prefix()) as tmp:
        local = Path(tmp) / str(output).rstrip("/").rsplit("/", 1)[-1]
        count = _export(paths, local, memory_bytes, log, on_rows)
        storage.upload_file(str(local), str(output))
    return count


def _export(paths: list, output: Path, memory_bytes: int, log: Log | None,
            on_rows: Callable[[int], None] | None) -> int:
    output.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_export_temporaries(output)
    written = 0

    def records() -> Iterator[pa.Table]:
        nonlocal written
        for table in iter_sorted(paths, output.parent, memory_bytes, log):
            yield table.select(RECORD_FIELDS)
            written += table.num_rows
            if on_rows:
                on_rows(table.num_rows)

    def write(tmp: str) -> None:
        if output.suffix == ".parquet":
            columns = passthrough_schema(paths)
            with pq.ParquetWriter(tmp, exported_schema(columns)) as writer:
                for table in records():
                    writer.write_table(expand_passthrough(table, columns))
            return
        with open(tmp, "w", encoding="utf-8") as f:
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
    schemas = []
    for path in paths:
        if "passthrough" not in metadata(path).schema.names:  # an output older than passed-through columns
            continue
        with closing_source(path) as source:
            values = [json.loads(t) for t in pq.read_table(source, columns=["passthrough"])["passthrough"].to_pylist()
                      if t]
        if values:
            schemas.append(_inferred(values, path))
    try:
        return pa.unify_schemas(schemas, promote_options="permissive") if schemas else pa.schema([])
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


# -- temporaries ----------------------------------------------------------------------------------

_TMP_PREFIX = ".pagefleet-export-"


def _temporary_prefix() -> str:
    """The sort's temporary directory name: it names this host and process, so that a later export can tell
    a killed export's leftovers (its process is gone) from a live export's."""
    return f"{_TMP_PREFIX}{socket.gethostname()}-{os.getpid()}-"


def remove_stale_export_temporaries(output: Path) -> int:
    """Remove what a killed export to `output` left beside it: the half-written `.NAME.*.tmp` (atomic_write's) and
    the sort's `.pagefleet-export-HOST-PID-*` directories whose process on this host is gone. Returns how many."""
    removed = 0
    for tmp in output.parent.glob(f".{output.name}.*.tmp"):
        if tmp.is_file():
            tmp.unlink(missing_ok=True)
            removed += 1
    host = socket.gethostname()
    for tmp in output.parent.glob(f"{_TMP_PREFIX}*"):
        owner, _, rest = tmp.name[len(_TMP_PREFIX):].rpartition("-")[0].rpartition("-")
        if not tmp.is_dir() or tmp.is_symlink() or owner != host or not rest.isdigit() or _alive(int(rest)):
            continue
        shutil.rmtree(tmp, ignore_errors=True)
        removed += 1
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


# -- the sort -------------------------------------------------------------------------------------

def _read(path: Path) -> pa.Table:
    try:
        with closing_source(path) as source:
            return conform(pq.read_table(source))
    except (pa.ArrowException, OSError, ValueError) as err:
        raise ValueError(f"the samples file {path} is corrupt or truncated ({err}); rerun `pagefleet run` with the "
                         "run's config: it finds the file on start and recomputes that batch") from None


def _sort(table: pa.Table) -> pa.Table:
    return table.take(pc.sort_indices(table, sort_keys=_SORT_KEYS))


def _sorted_in_memory(paths: list[Path]) -> Iterator[pa.Table]:
    if not paths:
        return
    yield _sort(pa.concat_tables([_read(p) for p in paths]))


def _write_sorted_runs(paths: list[Path], tmp: Path, run_bytes: int, total_rows: int, log: Log | None) -> list[Path]:
    runs: list[Path] = []
    pending: list[pa.Table] = []
    pending_bytes = pending_rows = 0
    group_rows = 0

    def flush() -> None:
        nonlocal pending, pending_bytes, pending_rows, group_rows
        if not group_rows:
            # The merge holds a row group of every run, the next one while the last is still referenced,
            # and the sorted copy of a round: a row group is a sixth of the run size over the runs.
            row_bytes = max(1.0, pending_bytes / max(1, pending_rows))
            num_runs = math.ceil(total_rows * row_bytes / run_bytes) + 1
            group_rows = max(1, int(run_bytes / 2 / num_runs / row_bytes))
        run = tmp / f"run-{len(runs):06d}.parquet"
        pq.write_table(_sort(pa.concat_tables(pending)), run, row_group_size=group_rows)
        runs.append(run)
        pending, pending_bytes, pending_rows = [], 0, 0

    for i, path in enumerate(paths, 1):
        table = _read(path)
        pending.append(table)
        pending_bytes += table.nbytes
        pending_rows += table.num_rows
        if pending_bytes >= run_bytes:
            flush()
            if log:
                log(f"sorted {i:,} of {len(paths):,} batches into {len(runs)} runs")
    if pending:
        flush()
    return runs


def _merge(runs: list[Path]) -> Iterator[pa.Table]:
    # One row group at a time, read explicitly: iter_batches reads ahead and would hold most of each run.
    files = [pq.ParquetFile(run) for run in runs]
    next_group = [0] * len(runs)
    buffers: list[pa.Table | None] = [None] * len(runs)

    def refill(i: int) -> None:
        while next_group[i] < files[i].num_row_groups:
            table = files[i].read_row_group(next_group[i])
            next_group[i] += 1
            if table.num_rows:
                buffers[i] = conform(table)
                return
        buffers[i] = None

    for i in range(len(runs)):
        refill(i)
    while any(b is not None for b in buffers):
        # Every run is sorted, so nothing still unread sorts before the smallest last buffered key.
        last = min(_key(b, b.num_rows - 1) for b in buffers if b is not None)
        pieces = []
        for i, buf in enumerate(buffers):
            if buf is None:
                continue
            n = _count_at_most(buf, last)
            if n:
                pieces.append(buf.slice(0, n))
            if n == buf.num_rows:
                refill(i)
            else:
                buffers[i] = buf.slice(n)
        yield _sort(pa.concat_tables(pieces))


def _key(table: pa.Table, i: int) -> tuple[int, int]:
    return table["row"][i].as_py(), table["generation_index"][i].as_py()


def _count_at_most(table: pa.Table, key: tuple[int, int]) -> int:
    """How many leading samples of a sorted table have (row, generation_index) <= key."""
    rows = table["row"].to_numpy()
    lo = int(np.searchsorted(rows, key[0], side="left"))
    hi = int(np.searchsorted(rows, key[0], side="right"))
    gens = table["generation_index"].to_numpy()[lo:hi]
    return lo + int(np.searchsorted(gens, key[1], side="right"))


def print_progress(message: str) -> None:
    print(f"pagefleet export: {message}", file=sys.stderr, flush=True)
