"""A slice: one process that owns an engine and runs the batches the head sends it.

The head calls `submit(work)` (queues a reference to a batch, returns at once; the slice reads the batch file
itself) and `poll(timeout_s)` (the results that are ready, and how many of the samples sent here have finished).
Flow control is the head's: each batch says at how many finished samples the head wants its poll back
(`BatchWork.wake_at`), and the slice only counts. A background thread
runs the engine and feeds it: the next queued batch enters the engine as soon as the current one's
requests have all been admitted, so the engine stays full across batch boundaries. A slice never
writes the run directory and never talks to the tracker; what it measured travels back with its
results.

This file is the actor and its engine thread; its parts: the spec and the engine's mesh (slice_spec.py), the
batches in the engine and their results (slice_batches.py), the timeline (slice_timeline.py), the inbox
(slice_inbox.py).
"""

from __future__ import annotations

import dataclasses
import os
import queue
import sys
import threading
import time
import traceback

import engine as lazy_engine  # its JAX names (Engine, the multi-host ones) load on first use, never in the head
from orchestrator.plan.model_cache import local_copy
from orchestrator.plan.model_source import load_tokenizer, ModelSourceConfig
from orchestrator.plan.weights_identity import check_weights
from orchestrator.slices.slice_batches import LiveBatches, batch_requests, batch_result
from orchestrator.slices.slice_inbox import Inbox
from orchestrator.slices.slice_spec import SliceSpec, engine_mesh
from orchestrator.slices.slice_timeline import Timeline
from orchestrator.state.batch_files import BatchFileError, check_reachable, on_hosts, prefetch
from orchestrator.state.faults import crash_point
from orchestrator.state.results import BatchWork, Failed, Result


class SliceWorker:
    """Wrapped with `ray.remote(max_concurrency=...)` by the driver; usable directly in one process too.

    A data-parallel slice (`cluster.mesh.data` D > 1 on one host) runs D engines, each a lane of this worker on
    its own devices, thread and scheduler. The lanes share the slice's inbox and outbox: a lane whose engine has
    admitted every request it holds takes the next batch in the head's order, so every engine stays full; the
    head's budget and the finished-sample count are the slice's, summed over its lanes."""

    def __init__(self, spec: SliceSpec, parent: SliceWorker | None = None) -> None:
        self.spec = spec
        self._parent = parent
        self._inbox = parent._inbox if parent else Inbox()
        self._outbox: queue.Queue[Result] = parent._outbox if parent else queue.Queue()
        self._stop = parent._stop if parent else threading.Event()
        self._wake_lock = parent._wake_lock if parent else threading.Lock()
        self._lanes: list[SliceWorker] = []  # the slice's engines when data parallel (this worker then runs none)
        self._fatal: str | None = None
        self._thread: threading.Thread | None = None
        self.engine = None
        self._batches = LiveBatches()
        self._timeline = Timeline(spec.engine.max_seqs)
        self.steps = 0  # engine steps taken: the head's sign of life for this slice
        self.samples_finished = 0
        """Samples sent here that left the slice's work: finished by the engine, or in a batch that failed.
        Only grows (written by the engine thread alone)."""
        self._woken_at: int | None = None  # the head's last `wake_at` that woke it

    # -- called by the head ----------------------------------------------------------------------

    def coordinator_address(self) -> str:
        """host 0: "ip:port" for the slice's jax.distributed coordinator (a port free on this node now)."""
        import socket

        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"{ray.util.get_node_ip_address()}:{port}"

    def start(self, coordinator: str | None = None) -> dict:
        """Join the slice (multi-host), load the model (once) and start the engine thread.

        Returns what was loaded, for the head's log. On a multi-host slice every host calls this with
        host 0's coordinator address; the Engine then checks, before its first compiled call, that every
        host holds the same configuration.
        """
        t0 = time.perf_counter()
        crash_point("slice_start")
        if self.spec.batches_dir is not None:
            check_reachable(self.spec.batches_dir, self.spec.name)
        if self.spec.spmd:
            lazy_engine.initialize_distributed(coordinator, self.spec.num_hosts, self.spec.host_index,
                                               self.spec.devices_per_host)

        if self.spec.weights is not None:  # weights changed in place since planning are refused, never mixed
            check_weights(self.spec.model_path, self.spec.weights)

        tokenizer = load_tokenizer(ModelSourceConfig(path=self.spec.model_path, tokenizer=self.spec.tokenizer_path,
                                                     cache_dir=self.spec.model_cache_dir))
        # gs://: each host reads only its devices' shards by ranged reads, or, with model.cache_dir, copies the
        # checkpoint there once and loads it from there (docs/storage.md)
        fetch = local_copy(self.spec.model_path, self.spec.model_cache_dir) if self.spec.model_cache_dir else None
        width = self.spec.mesh.get("model", 1)
        self._lanes = [SliceWorker(dataclasses.replace(self.spec, device_offset=i * width), parent=self)
                       for i in range(self.spec.engines)] if self.spec.engines > 1 else []
        for lane in self._lanes or [self]:
            lane._start_engine(fetch.local_path if fetch else self.spec.model_path, tokenizer)
        engines = [lane.engine for lane in self._lanes or [self]]
        import jax

        return {"slice": self.spec.name, "pid": os.getpid(), "load_s": time.perf_counter() - t0,
                "model_bytes_read": fetch.bytes_read if fetch else sum(e.load_report["bytes_read"] for e in engines),
                "model_fetch_s": fetch.seconds if fetch else sum(e.load_report["load_s"] for e in engines),
                "devices": [str(d) for d in jax.devices()], "engines": self.spec.engines,
                "processes": jax.process_count(),  # 1 on every host of a host-level data-parallel slice
                "modules": sorted(sys.modules)}  # what this process imported to run its engines (run_events)

    def _start_engine(self, model_path: str, tokenizer) -> None:
        mesh = engine_mesh(self.spec, lane=self._parent is not None)
        self.engine = lazy_engine.Engine(model_path, self.spec.engine, dtype=self.spec.dtype, mesh=mesh,
                                         tokenizer=tokenizer)
        name = f"{self.spec.name}-engine" + (f"-{self._lane}" if self._parent else "")
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def _lane(self) -> int:
        """This engine's index in a data-parallel slice."""
        return self.spec.device_offset // self.spec.mesh.get("model", 1)

    def submit(self, work: BatchWork) -> None:
        self._inbox.put(work, prefetch(work.path))  # read here, on the actor's thread, not the engine's

    def poll(self, timeout_s: float) -> tuple[list[Result], int, int]:
        """(results ready now, engine steps so far, samples finished so far), waiting up to `timeout_s` for a
        first result, or for the slice to fall below the head's budget (`_wake_head`); raises if the engine
        thread died."""
        out: list[Result | None] = []
        try:
            out.append(self._outbox.get(timeout=timeout_s))
            while True:
                out.append(self._outbox.get_nowait())
        except queue.Empty:
            pass
        results = [r for r in out if r is not None]  # None: the slice fell below its budget (_wake_head)
        fatal = next((w._fatal for w in self._lanes or [self] if w._fatal is not None), None)
        if not out and fatal is not None:
            raise RuntimeError(f"slice {self.spec.name}'s engine thread died: {fatal}")
        return results, self.total_steps, self.total_samples_finished  # read last: it counts every result returned

    @property
    def total_steps(self) -> int:
        """Engine steps taken by every engine of the slice."""
        return sum(w.steps for w in self._lanes) if self._lanes else self.steps

    @property
    def total_samples_finished(self) -> int:
        """`samples_finished` summed over the slice's engines."""
        return sum(w.samples_finished for w in self._lanes) if self._lanes else self.samples_finished

    def pid(self) -> int:
        return os.getpid()

    def stop(self) -> None:
        self._stop.set()

    # -- the engine thread -----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._feed()
                if self.engine.has_unfinished:
                    self._step()
        except BaseException:  # a bug in this loop: poll() reports it and the head restarts the slice
            self._fatal = traceback.format_exc()

    def _feed(self) -> None:
        """Queue the next batch whenever every request already in the engine has been admitted.

        A multi-host slice must feed the same batches at the same steps on every host: every host
        receives the same batches in the same order, an idle engine waits for the next one (the same
        on every host), and a busy engine feeds when host 0 says so (one small broadcast a step).
        """
        if self.spec.spmd:
            self._feed_in_step()
            return
        while self.engine.num_waiting == 0:
            work = self._inbox.get(timeout_s=0.05 if not self.engine.has_unfinished else 0.0)
            if work is None:
                return
            self._start(work)

    def _feed_in_step(self) -> None:
        if not self.engine.has_unfinished:
            work = self._next_work()
            if work is not None:
                self._start(work)
            return
        if self.engine.num_waiting:
            return  # the same on every host: the engine's state is
        import numpy as np
        from jax.experimental import multihost_utils

        ready = np.int32(self.spec.host_index == 0 and self._inbox.ready())
        if int(multihost_utils.broadcast_one_to_all(ready)):
            work = self._next_work()
            if work is not None:
                self._start(work)

    def _next_work(self) -> tuple[BatchWork, object] | None:
        """The next batch from the head and its prompts, waiting for it (None when stopping)."""
        while not self._stop.is_set():
            work = self._inbox.get(timeout_s=0.05)
            if work is not None:
                return work
        return None

    def _start(self, item: tuple[BatchWork, object]) -> None:
        work, loaded = item  # the batch and its prompts as read when it arrived (or the read's error)
        sampling = self.spec.sampling
        try:
            prompts = on_hosts(loaded, work.path, work.batch_id, self.spec.spmd)
        except BatchFileError as e:
            self.samples_finished += work.num_prompts * sampling.n if work.num_samples is None else work.num_samples
            self._emit(Failed(work.batch_id, work.attempt, self.spec.name, str(e), deterministic=e.deterministic))
            return
        requests = batch_requests(prompts, sampling)
        for r in (r for r in requests if r.generation_index == 0 or r.is_scored):  # each prompt, each continuation
            error = self.engine.validate(r)
            if error is not None:
                self.samples_finished += len(requests)
                self._emit(Failed(work.batch_id, work.attempt, self.spec.name, f"prompt {r.prompt_id!r}: {error}",
                                  deterministic=True))
                return
        self._batches.add(work, prompts, requests)
        for r in requests:
            self.engine.add_request(r)

    def _step(self) -> None:
        started = time.time()
        try:
            finished = self.engine.step()
        except Exception:
            error = traceback.format_exc(limit=8)
            for live in self._batches.drop():
                self.samples_finished += live.expected - len(live.done)
                self._emit(Failed(live.work.batch_id, live.work.attempt, self.spec.name, error))
            self.engine.abort()
            return
        self.steps += 1
        stats = self.engine.stats
        live_seqs, tokens = stats.active_seqs[-1], stats.decode_tokens[-1]
        self._batches.count_step(live_seqs, self.engine.num_pages_in_use)  # per step: no scan of the pool
        self._timeline.add_step(stats, started, live_seqs, tokens)
        self.samples_finished += len(finished)
        for batch in self._batches.finish(finished):
            self._emit(batch_result(batch, self.spec))
            if self.spec.engine.cleanup_mode == "end":  # a batch is this mode's "call"
                self.engine.release_finished()
        if not self.engine.has_unfinished:
            self.engine.settle()  # idle: every page back (the prefix cache kept), the same way on every host
        self._wake_head()

    def _wake_head(self) -> None:
        """Return the head's pending poll once as many samples have finished as the head's last batch asked
        (`BatchWork.wake_at`): the head then sends the next batch now, not at this one's end (many steps later
        when one long sample holds a batch open). At most once per `wake_at`, so at most once per batch."""
        if self._parent is not None:
            self._parent._wake_head()  # the count is the slice's, over all its engines
            return
        with self._wake_lock:
            wake_at = self._inbox.wake_at
            if wake_at is None or wake_at == self._woken_at or (self.spec.spmd and self.spec.host_index != 0):
                return
            if self.total_samples_finished >= wake_at:
                self._woken_at = wake_at
                self._outbox.put(None)

    def _emit(self, result: Result) -> None:
        # The steps so far travel with this result (a run's last steps are counted too); taken on every host, so
        # that none grows its timeline for days.
        timeline = self._timeline.take(self.engine.stats)
        if self._parent is not None or (self.spec.num_hosts > 1 and not self.spec.spmd):
            # which engine of a data-parallel slice took these steps (numbered across its hosts)
            engine = self.spec.host_index * self.spec.engines + (self._lane if self._parent is not None else 0)
            timeline = [{**b, "engine": engine} for b in timeline]
        if self.spec.spmd and self.spec.host_index != 0:
            return  # every host computed it; host 0 alone returns it
        self._outbox.put(dataclasses.replace(result, timeline=timeline))
