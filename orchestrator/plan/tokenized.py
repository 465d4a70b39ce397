"""The tokenized corpus, where planning keeps it: in this process for a small corpus, on the cluster for a large one.

Both run the same code on the same shards (`count_rows`, `PromptTokenizer.tokenize_shard`, `assign_batches`,
`write_grouped`), so a plan does not depend on where it was made; only the place and the start-up differ. On the
cluster, plain Ray tasks tokenize a shard each on the worker processes Ray keeps started (each loads the tokenizer
once, at its first shard), then others write the batch files, each over a range of batches. Not Ray Data: its
actor pool booted new processes for every window (~3.5-5 s of a 1M-row window's ~70 on 2 cores, and the workers it
displaced booted again for the summaries). A corpus of at most `corpus.in_process_bytes` is read, tokenized and
grouped into batch files by the head itself instead, which holds its token ids (a few bytes per corpus byte) for
the length of a window.

Either way the corpus is counted first (every shard's rows), then planned a window of `corpus.window_rows` rows at a
time (planner.py): each window is tokenized, packed and written, then released.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from orchestrator.plan.corpus import Shard, count_rows, number_shards
from orchestrator.plan.inline import array_pieces, from_pieces, table_pieces
from orchestrator.plan.tokenize import SCHEMA, PromptTokenizer
from orchestrator.slices.cluster import ClusterConfig, ensure_ray
from orchestrator.state.faults import crash_point
from orchestrator.state.manifest import batch_id
from orchestrator.storage import storage
from orchestrator.storage.atomic import atomic_write_parquet, parquet_bytes, write_whole

SUMMARY_COLUMNS = ["row", "prompt_id", "num_tokens", "reason", "detail", "file_index", "line", "page_keys",
                   "max_new_tokens", "num_continuations", "prefill_tokens"]
BATCH_SCHEMA = pa.schema([("prompt_id", pa.string()), ("row", pa.int64()), ("token_ids", pa.list_(pa.int32())),
                          ("passthrough", pa.string()), ("sampling", pa.string()),
                          ("continuations", pa.list_(pa.list_(pa.int32())))])
"""batches/<id>.parquet. `passthrough` (SampleRecord.passthrough: the row's other columns and typed id),
`sampling` (the row's own sampling overrides, orchestrator.plan.row_sampling) and `continuations` (a scored row's
continuations' token ids, `token_ids` being its context; null for a sampled row) are absent from plans older than
them."""


def corpus_bytes(files: list[str]) -> int:
    """The corpus's size on its storage (compressed parquet counts as stored)."""
    return sum(storage.filesystem(f)[0].size(storage.filesystem(f)[1]) for f in files)


@dataclass(frozen=True)
class Assignment:
    """Where the packing put each row of a planning window: `batch[r - first_row]` (-1: rejected) and
    `position[r - first_row]` for the window's row r; `id_bound` names the files (manifest.batch_id)."""

    first_row: int
    batch: np.ndarray
    position: np.ndarray
    id_bound: int


def assign_batches(table: pa.Table, assignment: Assignment) -> pa.Table:
    """The accepted rows of a tokenized table, each with its batch and its position in that batch."""
    rows = table["row"].to_numpy() - assignment.first_row
    batch_of_row, position_of_row = assignment.batch, assignment.position
    table = table.select(BATCH_SCHEMA.names)
    table = table.append_column("batch", pa.array(batch_of_row[rows]))
    table = table.append_column("position", pa.array(position_of_row[rows]))
    return table.filter(pc.greater_equal(table["batch"], 0))


def write_batch(group: pa.Table, index: int, batches_dir: str, id_bound: int) -> None:
    """batches/<id>.parquet of batch `index`: `group`, its rows in BATCH_SCHEMA and in their order (longest first).

    Written in place, not through a temporary file renamed over it: a plan's batch files count only once the manifest
    naming them is written (after one os.sync for them all), and a plan that did not finish removes them before
    planning again. Without dictionaries or statistics (no reader filters on them; a dictionary of token ids makes
    a file larger and slower to write for a real vocabulary: 312 against 240 KB, 2.7 against 0.9 ms, for 30 prompts
    of 2k tokens of a 128k vocabulary). Made in memory and written in one write (atomic.parquet_bytes). A batch file
    cost ~0.9 ms of CPU on a 2-core cloud machine, 0.5 ms of it the kernel creating the file; the temporary file's
    rename and its checks added ~0.2 ms."""
    path = f"{batches_dir}/{batch_id(index, id_bound)}.parquet"
    crash_point("batch_file")
    if storage.is_object_store(path):
        atomic_write_parquet(path, group, fsync=False)  # an upload, atomic by itself
        return
    try:
        write_whole(path, parquet_bytes(group, use_dictionary=False, write_statistics=False))
    except OSError as e:
        e.filename = e.filename or path  # a full disk's error names no file by itself
        raise


@dataclass
class InProcess:
    """A planning window's tokenized rows as one table in this process."""

    table: pa.Table

    @classmethod
    def tokenize(cls, shards: list[Shard], tokenizer_args: tuple) -> InProcess:
        if not shards:
            return cls(SCHEMA.empty_table())
        tokenizer = PromptTokenizer(*tokenizer_args)
        return cls(pa.concat_tables([tokenizer.tokenize_shard(s) for s in shards]))

    def summaries(self) -> list[pa.Table]:
        return [self.table.select(SUMMARY_COLUMNS)]

    def write_batches(self, assignment: Assignment, batches_dir: str, batches: tuple[int, int], tokens: int) -> int:
        """Write the window's batch files; returns how many were written."""
        return write_grouped([assign_batches(self.table, assignment)], batches_dir, assignment.id_bound)

    def release(self) -> None:
        self.table = SCHEMA.empty_table()


def write_grouped(parts: list[pa.Table], batches_dir: str, id_bound: int) -> int:
    """Write the batch file of every batch among `parts` (assign_batches tables; a batch's rows may be spread over
    several); returns how many were written."""
    # One sort and one cast for all of them (not one a batch: those cost more than writing its file); each batch's
    # rows are then a slice, in their order.
    assigned = pa.concat_tables(parts).sort_by([("batch", "ascending"), ("position", "ascending")])
    batches = assigned["batch"].to_numpy()
    rows = assigned.select(BATCH_SCHEMA.names).cast(BATCH_SCHEMA)
    starts = np.flatnonzero(np.r_[True, batches[1:] != batches[:-1]]) if len(batches) else np.zeros(0, np.int64)
    ends = np.r_[starts[1:], len(batches)]
    for start, end in zip(starts, ends):
        write_batch(rows.slice(start, end - start), int(batches[start]), batches_dir, id_bound)
    return len(starts)


def split_by_batch(table: pa.Table, assignment: Assignment, bounds: np.ndarray) -> list[pa.Table]:
    """The accepted rows of a tokenized block, cut into the batch ranges [bounds[p], bounds[p + 1])."""
    assigned = assign_batches(table, assignment).sort_by("batch")
    cuts = np.searchsorted(assigned["batch"].to_numpy(), bounds)
    return [assigned.slice(cuts[p], cuts[p + 1] - cuts[p]) for p in range(len(bounds) - 1)]


@dataclass
class OnRay:
    """A planning window's tokenized rows as Ray objects, a table per shard, spread over the cluster's object stores.
    What crosses to and from the head goes in inline pieces (inline.py): the head maps no page of the object store."""

    blocks: list
    """Each shard's table (an object ref), in shard order."""
    workers: int
    row_ranges: list[tuple[int, int]] = field(default_factory=list)
    """Each block's first row and the row after its last (0, 0 for an empty one), once `summaries` has read them."""

    @classmethod
    def tokenize(cls, shards: list[Shard], tokenizer_args: tuple, tokenizer_print: str, workers: int) -> OnRay:
        """A task a shard (`tokenize_on_worker`), on the workers Ray keeps started, until every shard is done; a
        shard's error is raised here (shard_tasks)."""
        import ray

        if not shards:
            return cls([], workers)
        args = ray.put(pickle.dumps((tokenizer_args, tokenizer_print)))
        task = ray.remote(num_cpus=1, num_returns=2)(tokenize_on_worker)
        return cls([table for table, _ in shard_tasks(task, shards, (args,), workers)], workers)

    def release(self) -> None:
        """Free the window's blocks in the object store before the next window is tokenized."""
        self.blocks = []

    def summaries(self) -> list[pa.Table]:
        """The window's summaries, a table per block, read in pieces by a task per block."""
        import ray

        read = ray.remote(num_cpus=1, num_returns="streaming")(summary_pieces)
        tables = [from_pieces([ray.get(piece) for piece in pieces], SUMMARY_SCHEMA)
                  for pieces in [read.remote(block) for block in self.blocks]]
        self.row_ranges = [(int(pc.min(t["row"]).as_py()), int(pc.max(t["row"]).as_py()) + 1) if t.num_rows else (0, 0)
                           for t in tables]
        return tables

    def write_batches(self, assignment: Assignment, batches_dir: str, batches: tuple[int, int], tokens: int) -> int:
        """Group the window's `tokens` accepted token ids by batch on Ray workers (ranges of `batches`, [first, end),
        holding about 32 MiB of them each, at least one per worker) and write the batch files there; returns how many
        were written."""
        import ray

        first, end = batches
        id_bound = assignment.id_bound
        partitions = min(max(self.workers, min(256, tokens * 4 // 2**25)), max(1, end - first))
        bounds = np.linspace(first, end, partitions + 1).round().astype(np.int64)
        # Plain tasks, not a Ray Data group-by: each tokenized block is cut into contiguous ranges of batches, and
        # one task per range gathers its pieces and writes the range's files with the in-process path's code. Each
        # block's task gets the assignment of its own rows, in inline pieces.
        split = ray.remote(num_cpus=1, num_returns=partitions)(split_block)
        pieces = []
        for block, (lo, hi) in zip(self.blocks, self.row_ranges):
            if hi == lo:
                continue
            rows = slice(lo - assignment.first_row, hi - assignment.first_row)
            batch, position = array_pieces(assignment.batch[rows]), array_pieces(assignment.position[rows])
            pieces.append(split.remote(block, bounds, lo, id_bound, len(batch), *batch, *position))
        pieces = [p if partitions > 1 else [p] for p in pieces]
        write = ray.remote(num_cpus=1)(lambda *parts: write_grouped(list(parts), batches_dir, id_bound))
        return sum(ray.get([write.remote(*[p[i] for p in pieces]) for i in range(partitions)]))


SUMMARY_SCHEMA = pa.schema([SCHEMA.field(c) for c in SUMMARY_COLUMNS])

_TOKENIZER: dict[bytes, PromptTokenizer] = {}
"""This worker process's tokenizer, by the pickled (arguments, tokenizer files' digest) it was built from: a plan
after the files changed in place builds another. One at a time."""


def tokenize_on_worker(shard: Shard, tokenizer_args: bytes) -> tuple[pa.Table, int]:
    """A Ray task: (`shard` tokenized, its rows). The worker's PromptTokenizer is built by its first shard and kept for
    the next (a worker runs many; building one reads the tokenizer's files). `tokenizer_args`: the pickled
    (PromptTokenizer's arguments, the tokenizer files' digest)."""
    tokenizer = _TOKENIZER.get(tokenizer_args)
    if tokenizer is None:
        _TOKENIZER.clear()
        tokenizer = _TOKENIZER[tokenizer_args] = PromptTokenizer(*pickle.loads(tokenizer_args)[0])
    table = tokenizer.tokenize_shard(shard)
    return table, table.num_rows


def shard_tasks(task, shards: list[Shard], args: tuple, workers: int) -> list[list]:
    """`task.remote(shard, *args)` for each shard, in order: each one's return refs, its row count (or counts) last.
    At most two tasks a worker are submitted at a time (one running, one queued behind it), the next as one ends,
    and none after one fails; then the first failed shard's own error is raised (a corpus file gone or unreadable:
    its one-line message, not Ray's traceback text), once the tasks started have ended, and every failed task's
    results are read, or Ray prints each as an error nobody handled.

    Nothing is cancelled: `ray.cancel` of a task whose reply is on its way can abort this process inside Ray (Ray
    2.60: "Check failed: it != submissible_tasks_.end() Tried to complete task that was not pending";
    ray-project/ray#54846 reports a variant), and a failed plan must end in its own error."""
    import ray

    refs, running = [], []
    for shard in shards:
        if len(running) >= 2 * max(1, workers):
            ended, running = ray.wait(running, num_returns=1)
            if _error(ended[0]) is not None:
                break
        returned = task.remote(shard, *args)
        refs.append(list(returned) if isinstance(returned, (list, tuple)) else [returned])
        running.append(refs[-1][-1])
    if running:
        ray.wait(running, num_returns=len(running))
    failed = [(returned, e) for returned in refs if (e := _error(returned[-1])) is not None]
    if not failed:
        return refs
    for returned, _ in failed:
        for ref in returned[:-1]:
            _error(ref)
    e = failed[0][1]
    raise (e.cause if isinstance(e.cause, Exception) else e) from e


def _error(ref):
    """The RayTaskError an ended task's result holds; None if it holds a value."""
    import ray

    try:
        ray.get(ref)
    except ray.exceptions.RayTaskError as e:
        return e
    return None


def summary_pieces(block: pa.Table) -> Iterator[bytes]:
    """A tokenized block's summaries, in inline pieces (a Ray streaming task)."""
    yield from table_pieces(block.select(SUMMARY_COLUMNS))


def split_block(block: pa.Table, bounds: np.ndarray, first_row: int, id_bound: int, num_pieces: int,
                *pieces: np.ndarray) -> pa.Table | list[pa.Table]:
    """split_by_batch of a block whose rows' batches and positions (from `first_row` on) come as `num_pieces` pieces
    of each; one table when there is one range (Ray's single return), else a list."""
    assignment = Assignment(first_row, np.concatenate(pieces[:num_pieces]), np.concatenate(pieces[num_pieces:]),
                            id_bound)
    parts = split_by_batch(block, assignment, bounds)
    return parts if len(parts) > 1 else parts[0]


def free_cpus() -> int:
    """The CPUs free in the Ray cluster now. Read while nothing of the plan runs: just after tasks end Ray's
    count of free resources lags (it reads no CPUs at all for a moment), and a plan sized from it would see one
    CPU on a cluster of many; the cluster's total stands in when the count has no CPU entry."""
    import ray

    free = ray.available_resources().get("CPU")
    return int(free if free is not None else ray.cluster_resources().get("CPU", 1))


def count(shards: list[Shard], cluster: ClusterConfig,
          in_process: bool) -> tuple[list[Shard], list[tuple[int, int]], int]:
    """Each shard numbered (its first row and line), each shard's (rows, lines), and how many shards the cluster
    tokenizes at once (0 in process): the CPUs free before the counting tasks take any, read once for the whole plan
    (see free_cpus)."""
    if in_process:
        counts = [count_rows(s) for s in shards]
        return number_shards(shards, counts), counts, 0
    import ray

    ensure_ray(cluster)
    workers = max(1, min(len(shards), free_cpus()))
    remote_count = ray.remote(num_cpus=1)(count_rows)
    counts = ray.get([counted for counted, in shard_tasks(remote_count, shards, (), workers)])
    return number_shards(shards, counts), counts, workers


def tokenize(shards: list[Shard], tokenizer_args: tuple, tokenizer_print: str, workers: int) -> InProcess | OnRay:
    """A window's shards (corpus.window_shards) tokenized here (`workers` 0) or on the cluster's Ray workers, by a
    PromptTokenizer(*tokenizer_args) of the tokenizer files whose digest is `tokenizer_print`."""
    if not workers:
        return InProcess.tokenize(shards, tokenizer_args)
    return OnRay.tokenize(shards, tokenizer_args, tokenizer_print, workers)
