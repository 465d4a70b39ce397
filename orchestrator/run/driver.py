"""`pagefleet run`: the head. Plans if needed, then runs every batch that is not done on slice actors.

The head owns all durable state (batches.jsonl, outputs/, events.log) and the tracker; RunState alone knows which
batches are pending, running where and tried how often. Slices get a reference to each batch's file, read the
prompts themselves, and return `Completed | Failed` as data. Each slice holds about
`cluster.samples_in_flight_per_slice` unfinished samples (default 2 x engine.max_seqs per engine; the slice
reports how many of those sent to it have finished): the next batches are already queued in its
engine when slots free up, so it never drains between batches, even while a batch waits on one long
sample; a slice that frees up pulls the next pending batch, so faster slices do more. A batch's outputs are written
atomically before it is marked done. A failed attempt is retried after an exponential backoff, up to
`retry.max_attempts`; a dead slice's batches go back to pending and the slice is replaced. A deterministic
fault is never retried: a batch whose prompts the engine refuses, whose logits are not finite or whose batch
file is missing is failed at once; a checkpoint the slices cannot load (found by name at the head from the
safetensors headers, or NaN/Inf found by a slice as it loads) and a full disk stop the run (exit_codes.FAULT).
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from dataclasses import dataclass

from engine import check_checkpoint
from orchestrator import exit_codes
from orchestrator.config import RunConfig
from orchestrator.observe.plot import write_plot
from orchestrator.observe.progress import RunProgress
from orchestrator.observe.run_summary import RunSummary
from orchestrator.observe.timeline import read_timeline
from orchestrator.observe.tracking import make_tracker
from orchestrator.plan.continuation import sample_keys
from orchestrator.plan.planner import plan_locked, refuse_impossible
from orchestrator.plan.retune import retune
from orchestrator.run.signals import interrupt_on_signals, on_signals, restore_signals
from orchestrator.slices.cluster import ensure_ray
from orchestrator.slices.slice_gang import POLL_S, SliceGang
from orchestrator.slices.slice_layout import check_mesh, validate
from orchestrator.slices.waiting import WaitingReport
from orchestrator.state.batch_files import BatchFileError, read_batch
from orchestrator.state.disk_full import disk_full
from orchestrator.state.faults import crash_point
from orchestrator.state.lock import RunDirLocked
from orchestrator.state.output_plan import plan_fingerprint, stamp
from orchestrator.state.results import Completed, Failed
from orchestrator.state.run_events import EventStream, ReadySlice, SlicesReady, SliceStarted
from orchestrator.state.run_lock import run_lock
from orchestrator.state.run_state import RunState
from orchestrator.state.rundir import RunDir
from orchestrator.storage import location, object_append, storage
from orchestrator.storage.atomic import atomic_write_parquet
from orchestrator.storage.readable import reading


@dataclass
class _Slot:
    """One slice: its gang of host actors (replaced when it fails); the batches it holds are RunState's."""

    gang: SliceGang
    restarts: int = 0
    dead: str | None = None  # why it was given up on

    @property
    def name(self) -> str:
        return self.gang.name

    @property
    def ready(self) -> bool:
        return self.gang.ready


@dataclass(frozen=True)
class RunOutcome:
    exit_code: int
    """An `orchestrator.exit_codes` status: OK, BATCHES_FAILED, FAULT (stopped on a fault) or INTERRUPTED."""
    summary: dict
    fault: str | None = None
    """With FAULT: why the run stopped, in one line that names the file or key and the fix."""


class Driver:
    def __init__(self, cfg: RunConfig, show_progress: bool = True, stop: threading.Event | None = None) -> None:
        check_mesh(cfg)  # no model needed: a config error before the run directory is touched
        self.cfg = cfg
        self.run_dir = RunDir(location.location(cfg.resolved_run_dir))  # local, or gs:// (docs/storage.md)
        self.show_progress = show_progress
        self.stop = stop or threading.Event()
        self.slots: list[_Slot] = []
        self.events = EventStream()  # what the run loop reports as it happens (run_events.py); events.log is fed here
        self._samples_in_flight = cfg.samples_in_flight_per_slice
        self._fault: str | None = None  # why the run stopped early on a fault (exit_codes.FAULT)
        self._lock_lost = False  # another head took the run directory over: this one writes nothing more there
        self._waiting = WaitingReport(cfg.cluster)

    # -- the run ---------------------------------------------------------------------------------

    def run(self) -> RunOutcome:
        model = self.cfg.model.require_path()
        if not self.run_dir.is_planned():
            refuse_impossible(self.cfg)  # before the run directory or Ray exists

        with reading("model.path", model):  # headers only (ranged reads on gs://), before planning: a bad one
            check_checkpoint(model)  # stops the run once
        validate(self.cfg)  # the mesh against the devices and the model, the capacities: before any slice starts
        with run_lock(self.run_dir.root, self.cfg.lock_stale_s) as lock:
            self._lock = lock  # checked every turn of the loop: a head that lost it stops (object_lock.py)
            try:
                return self._run_locked()
            except OSError as e:
                full = disk_full(e, self.run_dir.root)
                if full is None:
                    raise
                _best_effort_event(self.run_dir, f"the run stopped: {full.strerror}")
                raise full from None

    def _run_locked(self) -> RunOutcome:
        previous = interrupt_on_signals()  # until the slices start: `ray job stop` (SIGTERM) stops like Ctrl-C
        try:
            return self._plan_and_execute()
        finally:
            restore_signals(previous)

    def _plan_and_execute(self) -> RunOutcome:
        planned = plan_locked(self.cfg)  # starts Ray only when there is something to plan
        self._lock.check()
        if not planned.already_planned:
            print(planned.stats.format())
        crash_point("planned")
        self._plan = plan_fingerprint(self.run_dir.read_run_json()["fingerprints"])
        state = RunState.recover(self.run_dir, self.cfg.sampling.n, self._plan)
        try:
            changed = retune(self.run_dir, state, self.cfg)  # other capacities than planned: re-pack what no longer fits
            if changed:
                print(changed)  # not only in events.log: the user changed them, the console says what it did
            todo = state.with_status("pending")
            if not todo:
                summary = RunSummary.read(self.run_dir, session=None, totals=state.totals()).run_figures()
                print(f"all {state.num_batches} batches of {self.run_dir.root} are done; nothing to compute")
                return RunOutcome(exit_codes.OK, summary)
            ensure_ray(self.cfg.cluster)
            return self._execute(state, [r.batch_id for r in todo])
        except RunDirLocked:  # the lock, or the manifest, went to another head
            self._lock_lost = True
            raise
        finally:
            try:
                if not self._lock_lost:  # another head owns the run directory now: write nothing more there
                    state.close()
            except OSError:
                if self._fault is None:
                    raise

    def _execute(self, state: RunState, todo: list[str]) -> RunOutcome:
        tracker = make_tracker(self.cfg.tracker, self.run_dir.root, self.cfg.name,
                               json.loads(json.dumps(dataclasses.asdict(self.cfg))))
        progress = RunProgress(self.run_dir, state.totals(), self.show_progress)
        self._state, self._tracker, self._progress = state, tracker, progress
        self._samples_tracked = 0
        self._loop_started = time.monotonic()
        self.events.subscribe(lambda event: state.event(event.line()))
        state.event(f"run started: {len(todo)} of {state.num_batches} batches to do, "
                    f"{self.cfg.cluster.num_slices} slices")
        previous = on_signals(self.stop)
        try:
            self.slots = [_Slot(SliceGang(i, self.cfg)) for i in range(self.cfg.cluster.num_slices)]
            for slot in self.slots:
                slot.gang.spawn()
            self._loop()
        except OSError as e:
            full = disk_full(e, self.run_dir.root)
            if full is None:
                raise
            self._fault = full.strerror
        except RunDirLocked:  # lost the lock (or the manifest to another head): leave the run directory to it
            self._lock_lost = True
            for slot in self.slots:
                slot.gang.kill()
            progress.bar.close()
            raise
        finally:
            restore_signals(previous)
            if not self._lock_lost:
                summary, stopped = self._wind_down(state, progress, tracker)
        if self._fault is not None:
            return RunOutcome(exit_codes.FAULT, summary, self._fault)
        if stopped:
            return RunOutcome(exit_codes.INTERRUPTED, summary)
        return RunOutcome(exit_codes.OK if summary["batches_done"] == summary["batches"] else exit_codes.BATCHES_FAILED,
                          summary)

    def _wind_down(self, state: RunState, progress: RunProgress, tracker) -> tuple[dict, bool]:
        """Stop the slices, put their batches back to pending, write the final state; (summary, stopped)."""
        stopped = self.stop.is_set()
        requeued = []
        for slot in self.slots:
            for batch_id in state.running_on(slot.name):  # stopped mid-batch: resumable, nothing half-done stays running
                state.update(batch_id, status="pending")
                requeued.append(batch_id)
            slot.gang.kill()
        try:
            for batch_id in requeued:
                state.event(f"{batch_id} back to pending: the run stopped")
            if self._fault is not None:
                state.event(f"the run stopped on a fault: {self._fault}")
            state.flush(force=True)
        except OSError:
            if self._fault is None:
                raise  # with a fault (a full disk), the state written so far is the resume point
        try:  # builds the session's final figures (progress.session) even where the disk refuses them
            progress.write(state.prompts_not_done, force=True, running=False, fault=self._fault)
        except OSError:
            if self._fault is None:
                raise
        progress.close()
        # The run's figures, once: what was just written (the manifest's records, progress.json's session figures)
        timeline = read_timeline(self.run_dir)
        figures = RunSummary.read(self.run_dir, session=progress.session, timeline=timeline, totals=state.totals())
        tracker.finish(figures.tracker_figures())
        if self._fault is None:
            self._plot(timeline, figures.tokens_per_s)
        print(figures.format_run())
        return figures.run_figures(), stopped

    def _loop(self) -> None:
        import ray

        announced = False
        while self._state.counts["pending"] or self._state.counts["running"]:
            self._lock.check()  # a head that lost its run directory stops within POLL_S of knowing it
            if self._fault is not None:
                return
            if self.stop.is_set():
                self._state.event("stop requested; leaving the remaining batches pending")
                return
            live = [s for s in self.slots if s.dead is None]
            if not live:
                reasons = "; ".join(f"{s.name}: {s.dead}" for s in self.slots)
                self._state.event(f"every slice failed; stopping ({reasons})")
                self._fault = f"every slice failed, so the remaining batches stay pending ({reasons})"
                return
            for slot in live:
                self._top_up(slot)
            if not announced and all(s.ready for s in live):
                announced = True
                self.events.emit(SlicesReady(tuple(
                    ReadySlice(s.name, tuple(s.gang.pids), tuple(self._state.running_on(s.name))) for s in live),
                    time.monotonic() - self._loop_started))
            self._waiting.check(sum(not s.ready for s in live), len(live), self._progress, self._state)
            refs = {ref: s for s in live for ref in s.gang.refs()}
            ready, _ = ray.wait(list(refs), num_returns=1, timeout=POLL_S)
            for ref in ready:
                self._handle(refs[ref], ref)
            for slot in live:
                hung = slot.dead is None and slot.gang.timed_out(bool(self._state.running_on(slot.name)))
                if hung:
                    self._slice_failed(slot, hung)
            self._state.flush()
            self._progress.write(self._state.prompts_not_done)

    # -- slices ----------------------------------------------------------------------------------

    def _handle(self, slot: _Slot, ref) -> None:
        event = slot.gang.handle(ref)
        if event.kind == "failed" and event.fatal:  # e.g. NaN weights: every slice would fail the same way
            self._state.event(f"{slot.name} {event.reason}; stopping the run: restarting cannot help")
            self._fault = f"{slot.name} {event.reason}"
        elif event.kind == "failed":
            self._slice_failed(slot, event.reason)
        elif event.kind == "started":
            self.events.emit(SliceStarted.from_info(slot.name, event.info))
        elif event.kind == "results":
            # The poll brought the slice's count of finished samples: send its next batches first, then write the
            # results (outputs, fsynced): a slice whose queue ran low must not wait on the head's disk.
            self._top_up(slot)
            for result in event.results:
                self._result(slot, result)

    def _result(self, slot: _Slot, result) -> None:
        self._progress.add_timeline(slot.name, result.timeline)
        record = self._state.record(result.batch_id)  # None: done meanwhile
        if record is None or (record.status, record.slice, record.attempts) != ("running", slot.name, result.attempt):
            self._state.event(f"{slot.name}: ignored a stale result for {result.batch_id}")
            return
        if isinstance(result, Failed):
            self._attempt_failed(result.batch_id, f"on {slot.name}: {result.error}", final=result.deterministic)
        else:
            self._completed(slot, result)

    def _slice_failed(self, slot: _Slot, reason: str) -> None:
        """Requeue the slice's batches and replace it (up to cluster.max_slice_restarts times)."""
        self._state.event(f"{slot.name} {reason}")
        for batch_id in self._state.running_on(slot.name):
            self._attempt_failed(batch_id, f"{slot.name} {reason}")
        slot.gang.kill()
        if slot.restarts >= self.cfg.cluster.max_slice_restarts:
            slot.dead = reason
            self._state.event(f"{slot.name} given up after {slot.restarts} restarts")
            return
        slot.restarts += 1
        self._state.event(f"{slot.name} restarting ({slot.restarts} of {self.cfg.cluster.max_slice_restarts})")
        slot.gang.spawn()

    # -- batches ---------------------------------------------------------------------------------

    def _next_batch(self) -> str | None:
        """The first pending batch whose retry backoff is over (RunState keeps the order and the attempts)."""
        return self._state.next_due(time.time(), self.cfg.retry.wait_s)

    def _top_up(self, slot: _Slot) -> None:
        """Send the slice pending batches until it holds `_samples_in_flight` unfinished samples (or one batch);
        nothing once the run is stopping (a stop asked for, or a fault)."""
        if self.stop.is_set() or self._fault is not None:
            return
        while slot.ready and (not self._state.running_on(slot.name)
                              or slot.gang.samples_held < self._samples_in_flight):
            batch_id = self._next_batch()
            if batch_id is None:
                return
            self._dispatch(slot, batch_id)

    def _dispatch(self, slot: _Slot, batch_id: str) -> None:
        record = self._state.mark_running(batch_id, slot.name)
        slot.gang.submit(batch_id, record.attempts, record.num_prompts,  # a reference: the slice reads the file
                         record.samples(self.cfg.sampling.n))
        crash_point("dispatched")

    def _attempt_failed(self, batch_id: str, error: str, final: bool = False) -> None:
        """Back to pending (retried after a backoff), or failed: when `final` (a deterministic fault) or out of attempts."""
        final = final or self._state.attempts(batch_id) >= self.cfg.retry.max_attempts
        self._state.mark_failed(batch_id, error, final)

    def _completed(self, slot: _Slot, result: Completed) -> None:
        n = self.cfg.sampling.n
        columns = ["prompt_id"] + (["continuations"] if self._state.record(result.batch_id).expected_samples
                                   is not None else [])  # a batch with scored rows: their continuations count
        try:  # the batch's prompt ids (never its token ids): what the samples must be, and their stamp
            prompts = read_batch(self.run_dir.batch_file(result.batch_id), columns)
        except BatchFileError as e:
            self._attempt_failed(result.batch_id, str(e), final=True)
            return
        prompt_ids = prompts["prompt_id"].to_pylist()
        samples = result.samples
        expected = sample_keys(prompts, n)
        if list(zip(samples.column("prompt_id").to_pylist(), samples.column("generation_index").to_pylist())) != expected:
            self._attempt_failed(result.batch_id, f"{slot.name} returned {samples.num_rows} samples that do not match "
                                 f"the batch's {len(expected)} samples of {len(prompt_ids)} prompts (internal error)")
            return
        atomic_write_parquet(self.run_dir.output_file(result.batch_id), stamp(samples, self._plan, prompt_ids),
                             before_replace=lambda: crash_point("output_tmp"))
        crash_point("output_written")
        record = self._state.mark_done(result.batch_id, result.stats, slot.name,
                                       output_bytes=storage.file_size(self.run_dir.output_file(result.batch_id)))
        done = self._state.counts["done"]
        self._progress.batch_done(record, done, self._state.counts["failed"])
        s = result.stats
        self._tracker.log_batch({
            "batch_id": record.batch_id, "slice": slot.name, "num_prompts": record.num_prompts,
            "num_samples": s.num_samples, "num_prompt_tokens": record.num_prompt_tokens,
            "num_output_tokens": s.num_output_tokens, "duration_s": s.duration_s,
            "tokens_per_s": s.num_output_tokens / max(s.duration_s, 1e-9), "pages": s.max_pages_in_use,
            "occupancy": s.occupancy, "attempts": record.attempts, "batches_done": done})
        wanted = self.cfg.tracker.samples_table_rows - self._samples_tracked  # the table is bounded: stop when full
        if wanted > 0 and samples.num_rows:
            rows = samples.slice(0, wanted).drop_columns(["logprobs"]).to_pylist()
            self._tracker.add_samples(rows)
            self._samples_tracked += len(rows)

    # -- the end ---------------------------------------------------------------------------------

    def _plot(self, timeline: list[dict], mean_tokens_per_s: float | None) -> None:
        try:
            t0 = min((b["t"] for b in timeline), default=0.0)
            write_plot(self.run_dir.plot, [{**b, "t": b["t"] - t0} for b in timeline], mean_tokens_per_s)
        except Exception as e:  # noqa: BLE001 - the plot is a report, never a reason to fail the run
            self._state.event(f"could not write the throughput plot: {e}")


def run(cfg: RunConfig, show_progress: bool = True) -> RunOutcome:
    return Driver(cfg, show_progress).run()


def _best_effort_event(run_dir: RunDir, text: str) -> None:
    """Append to events.log where the head's RunState is not at hand; a full disk may refuse even this."""
    try:
        with object_append.open_append(run_dir.events) as f:
            f.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S%z')} {text}\n")
    except OSError:
        pass

