"""A slice: one process that owns an engine and runs the batches the head sends it.

The head calls `submit(work)` (queues a batch, returns at once) and `poll(timeout_s)` (the results
that are ready). A background thread runs the engine and feeds it: the next queued batch enters the
engine as soon as the current one's requests have all been admitted, so the engine stays full across
batch boundaries. A slice never writes the run directory and never talks to the tracker; what it
measured travels back with its results.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field

import pyarrow as pa

from engine.config import EngineConfig, SamplingConfig
from orchestrator.results import SAMPLE_SCHEMA, BatchStats, BatchWork, Completed, Failed, Result, with_stats

TIMELINE_BUCKET_S = 1.0


@dataclass(frozen=True)
class SliceSpec:
    """Everything a slice needs to build its engine (plain data, sent to the actor)."""

    name: str
    model_path: str
    tokenizer_path: str
    dtype: str
    engine: EngineConfig
    sampling: SamplingConfig
    mesh: dict[str, int] = field(default_factory=lambda: {"model": 1})


@dataclass
class _Live:
    """A batch whose requests are in the engine."""

    work: BatchWork
    expected: int
    started: float
    done: dict[tuple[str, int], object] = field(default_factory=dict)
    steps: int = 0
    seq_steps: int = 0  # sum over its steps of live sequences in the engine
    max_pages: int = 0


class SliceWorker:
    """Wrapped with `ray.remote(max_concurrency=...)` by the driver; usable directly in one process too."""

    def __init__(self, spec: SliceSpec) -> None:
        self.spec = spec
        self._inbox: queue.Queue[BatchWork] = queue.Queue()
        self._outbox: queue.Queue[Result] = queue.Queue()
        self._stop = threading.Event()
        self._fatal: str | None = None
        self._thread: threading.Thread | None = None
        self.engine = None
        self._live: dict[str, _Live] = {}
        self._owner: dict[tuple[str, int], str] = {}  # (prompt_id, generation_index) -> batch_id
        self._timeline: list[dict] = []
        self._bucket = [time.time(), 0, 0, 0]  # start, steps, tokens, live sequences summed over steps

    # -- called by the head ----------------------------------------------------------------------

    def start(self) -> dict:
        """Load the model (once) and start the engine thread; returns what was loaded, for the head's log."""
        t0 = time.perf_counter()
        from engine.engine import Engine
        from orchestrator.model_source import ModelSourceConfig, load_tokenizer

        tokenizer = load_tokenizer(ModelSourceConfig(path=self.spec.model_path, tokenizer=self.spec.tokenizer_path))
        self.engine = Engine(self.spec.model_path, self.spec.engine, dtype=self.spec.dtype, mesh=self._mesh(),
                             tokenizer=tokenizer)
        self._thread = threading.Thread(target=self._run, name=f"{self.spec.name}-engine", daemon=True)
        self._thread.start()
        import jax

        return {"slice": self.spec.name, "pid": os.getpid(), "load_s": time.perf_counter() - t0,
                "devices": [str(d) for d in jax.devices()]}

    def submit(self, work: BatchWork) -> None:
        self._inbox.put(work)

    def poll(self, timeout_s: float) -> list[Result]:
        """Results ready now, waiting up to `timeout_s` for the first; raises if the engine thread died."""
        out: list[Result] = []
        try:
            out.append(self._outbox.get(timeout=timeout_s))
            while True:
                out.append(self._outbox.get_nowait())
        except queue.Empty:
            pass
        if not out and self._fatal is not None:
            raise RuntimeError(f"slice {self.spec.name}'s engine thread died: {self._fatal}")
        return out

    def pid(self) -> int:
        return os.getpid()

    def loaded_modules(self) -> list[str]:
        """Names in this process's sys.modules (lets tests prove what a slice never imported)."""
        return sorted(sys.modules)

    def stop(self) -> None:
        self._stop.set()

    # -- the engine thread -----------------------------------------------------------------------

    def _mesh(self):
        width = self.spec.mesh.get("model", 1)
        if width == 1:
            return None
        import jax
        import numpy as np
        from jax.sharding import Mesh

        devices = jax.devices()
        if len(devices) < width:
            raise ValueError(f"cluster.mesh.model={width} but this host has {len(devices)} devices; lower the mesh "
                             "width or set cluster.devices_per_host")
        return Mesh(np.asarray(devices[:width]).reshape(1, width), ("data", "model"))

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._feed()
                if self.engine.has_unfinished:
                    self._step()
        except BaseException:  # a bug in this loop: poll() reports it and the head restarts the slice
            self._fatal = traceback.format_exc()

    def _feed(self) -> None:
        """Queue the next batch whenever every request already in the engine has been admitted."""
        while self.engine.num_waiting == 0:
            try:
                work = self._inbox.get(timeout=0.05) if not self.engine.has_unfinished else self._inbox.get_nowait()
            except queue.Empty:
                return
            self._start(work)

    def _start(self, work: BatchWork) -> None:
        from engine.sequence import Request

        sampling = self.spec.sampling
        ids = work.prompts.column("prompt_id").to_pylist()
        requests = [Request(pid, tuple(tokens), sampling, generation_index=g)
                    for pid, tokens in zip(ids, work.prompts.column("token_ids").to_pylist())
                    for g in range(sampling.n)]
        for r in requests[::sampling.n]:
            error = self.engine.validate(r)
            if error is not None:
                self._emit(Failed(work.batch_id, work.attempt, self.spec.name, f"prompt {r.prompt_id!r}: {error}"))
                return
        self._live[work.batch_id] = _Live(work, len(requests), time.time())
        for r in requests:
            self._owner[(r.prompt_id, r.generation_index)] = work.batch_id
            self.engine.add_request(r)

    def _step(self) -> None:
        try:
            finished = self.engine.step()
        except Exception:
            error = traceback.format_exc(limit=8)
            for live in self._live.values():
                self._emit(Failed(live.work.batch_id, live.work.attempt, self.spec.name, error))
            self._live.clear()
            self._owner.clear()
            self.engine.abort()
            return
        stats = self.engine.stats
        live_seqs, tokens = stats.active_seqs[-1], stats.decode_tokens[-1]
        pages = self.engine.snapshot()["pages_in_use"]
        for live in self._live.values():
            live.steps += 1
            live.seq_steps += live_seqs
            live.max_pages = max(live.max_pages, pages)
        self._account(live_seqs, tokens)
        for c in finished:
            batch = self._live[self._owner.pop((c.prompt_id, c.generation_index))]
            batch.done[(c.prompt_id, c.generation_index)] = c
            if len(batch.done) == batch.expected:
                del self._live[batch.work.batch_id]
                self._emit(self._completed(batch))
                if self.spec.engine.cleanup_mode == "end":  # a batch is this mode's "call"
                    self.engine.release_finished()
        if not self.engine.has_unfinished:
            self.engine.reset()  # idle: every page back, the same way on every host

    def _completed(self, live: _Live) -> Completed:
        n = self.spec.sampling.n
        work = live.work
        ids, rows = work.prompts.column("prompt_id").to_pylist(), work.prompts.column("row").to_pylist()
        samples = [live.done[(pid, g)] for pid in ids for g in range(n)]
        columns = {
            "prompt_id": [c.prompt_id for c in samples],
            "generation_index": [c.generation_index for c in samples],
            "completion": [c.completion for c in samples],
            "token_ids": [c.token_ids for c in samples],
            "logprobs": [c.logprobs for c in samples],
            "finish_reason": [c.finish_reason for c in samples],
            "num_prompt_tokens": [c.num_prompt_tokens for c in samples],
            "batch_id": [work.batch_id] * len(samples),
            "row": [r for r in rows for _ in range(n)],
        }
        stats = BatchStats(
            num_samples=len(samples), num_output_tokens=sum(len(c.token_ids) for c in samples),
            duration_s=time.time() - live.started, num_steps=live.steps,
            occupancy=live.seq_steps / max(1, live.steps) / self.spec.engine.max_seqs, max_pages_in_use=live.max_pages)
        table = pa.Table.from_pydict(columns, schema=SAMPLE_SCHEMA)
        return Completed(work.batch_id, work.attempt, self.spec.name, with_stats(table, stats), stats)

    def _account(self, live_seqs: int, tokens: int) -> None:
        """Fold one step into the current 1 s timeline bucket."""
        b = self._bucket
        b[1] += 1
        b[2] += tokens
        b[3] += live_seqs
        now = time.time()
        if now - b[0] >= TIMELINE_BUCKET_S:
            self._timeline.append({"t": now, "steps": b[1], "tokens_per_s": b[2] / (now - b[0]),
                                   "occupancy": b[3] / b[1] / self.spec.engine.max_seqs})
            self._bucket = [now, 0, 0, 0]
            self.engine.stats.clear()  # only the last step is read here: keep a days-long run's memory flat

    def _emit(self, result: Result) -> None:
        timeline, self._timeline = self._timeline, []
        self._outbox.put(dataclasses.replace(result, timeline=timeline))
