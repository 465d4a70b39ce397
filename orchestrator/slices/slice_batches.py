"""The batches in a slice's engine: a batch file's rows become requests, each finished sample goes back to its
batch, and a batch whose every sample has finished becomes the result the head receives (its samples table, in
the batch's row order, and its stats)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pyarrow as pa

from engine import RECORD_FIELDS, Request, SamplingConfig
from orchestrator.plan.continuation import sample_keys, samples_per_row
from orchestrator.plan.row_sampling import apply
from orchestrator.slices.slice_spec import SliceSpec
from orchestrator.state.results import SAMPLE_SCHEMA, BatchStats, BatchWork, Completed, Failed, Result, with_stats


def batch_requests(prompts: pa.Table, sampling: SamplingConfig) -> list[Request]:
    """The engine's requests for a batch file's rows: `sampling.n` samples of each prompt, each row's own sampling
    overrides applied (validated when planned); a scored row's are one per continuation, its context followed by
    the continuation (as `pagefleet generate` makes them), in `continuation.sample_keys` order."""
    ids = prompts.column("prompt_id").to_pylist()
    own = prompts.column("sampling").to_pylist() if "sampling" in prompts.column_names else [None] * len(ids)
    scored = (prompts.column("continuations").to_pylist() if "continuations" in prompts.column_names
              else [None] * len(ids))
    requests = []
    for pid, tokens, overrides, continuations in zip(ids, prompts.column("token_ids").to_pylist(), own, scored):
        if continuations:
            requests += [Request(pid, tuple(tokens) + tuple(c), apply(sampling, overrides), generation_index=g,
                                 num_context_tokens=len(tokens)) for g, c in enumerate(continuations)]
        else:
            requests += [Request(pid, tuple(tokens), apply(sampling, overrides), generation_index=g)
                         for g in range(sampling.n)]
    return requests


@dataclass
class LiveBatch:
    """A batch whose requests are in the engine."""

    work: BatchWork
    prompts: pa.Table  # the batch file: prompt_id, row, token_ids (and passthrough, sampling)
    expected: int
    started: float
    done: dict[tuple[str, int], object] = field(default_factory=dict)
    steps: int = 0
    seq_steps: int = 0  # sum over its steps of live sequences in the engine
    max_pages: int = 0


class LiveBatches:
    """The batches whose requests are in one engine, and which batch each of its samples belongs to."""

    def __init__(self) -> None:
        self._live: dict[str, LiveBatch] = {}
        self._owner: dict[tuple[str, int], str] = {}  # (prompt_id, generation_index) -> batch_id

    def add(self, work: BatchWork, prompts: pa.Table, requests: list[Request]) -> None:
        self._live[work.batch_id] = LiveBatch(work, prompts, len(requests), time.time())
        for r in requests:
            self._owner[(r.prompt_id, r.generation_index)] = work.batch_id

    def count_step(self, live_seqs: int, pages: int) -> None:
        """One engine step, with `live_seqs` sequences in it and `pages` pages in use, for every live batch."""
        for live in self._live.values():
            live.steps += 1
            live.seq_steps += live_seqs
            live.max_pages = max(live.max_pages, pages)

    def finish(self, records: list) -> Iterator[LiveBatch]:
        """Give each finished sample to its batch; yields each batch as its last sample arrives (no longer live)."""
        for c in records:
            batch = self._live[self._owner.pop((c.prompt_id, c.generation_index))]
            batch.done[(c.prompt_id, c.generation_index)] = c
            if len(batch.done) == batch.expected:
                del self._live[batch.work.batch_id]
                yield batch

    def drop(self) -> list[LiveBatch]:
        """Forget every live batch (the engine failed and dropped their requests); returns them."""
        dropped = list(self._live.values())
        self._live.clear()
        self._owner.clear()
        return dropped


def batch_result(live: LiveBatch, spec: SliceSpec) -> Result:
    """A finished batch's result: its samples and stats, or a deterministic failure naming the first sample that
    could not run."""
    errors = [d for d in live.done.values() if d.error]
    if errors:
        return Failed(live.work.batch_id, live.work.attempt, spec.name,
                      f"prompt {errors[0].prompt_id!r}: {errors[0].error}", deterministic=True)
    work, prompts = live.work, live.prompts
    counts = samples_per_row(prompts, spec.sampling.n)
    samples = [live.done[key] for key in sample_keys(prompts, spec.sampling.n)]
    columns = {name: [getattr(c, name) for c in samples] for name in RECORD_FIELDS}
    columns["batch_id"] = [work.batch_id] * len(samples)  # the engine's records carry none
    columns["row"] = [r for r, k in zip(prompts.column("row").to_pylist(), counts) for _ in range(k)]
    if "passthrough" in prompts.column_names:  # the row's other columns and typed id (a plan's batch file)
        columns["passthrough"] = [p for p, k in zip(prompts.column("passthrough").to_pylist(), counts)
                                  for _ in range(k)]
    stats = BatchStats(
        num_samples=len(samples), num_output_tokens=sum(len(c.token_ids) for c in samples),
        duration_s=time.time() - live.started, num_steps=live.steps,
        occupancy=live.seq_steps / max(1, live.steps) / spec.engine.max_seqs, max_pages_in_use=live.max_pages)
    table = pa.Table.from_pydict(columns, schema=SAMPLE_SCHEMA)
    return Completed(work.batch_id, work.attempt, spec.name, with_stats(table, stats), stats)
