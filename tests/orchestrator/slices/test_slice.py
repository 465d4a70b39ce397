"""The slice in one process (no Ray): it reads each batch's file itself (the head sends a reference), its side of
the head's flow control (it counts finished samples one by one and returns the head's pending poll once as many
have finished as the head's last batch asked, before any batch has finished), and the timeline its results carry."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from engine.config import EngineConfig, SamplingConfig
from orchestrator.plan.tokenized import BATCH_SCHEMA
from orchestrator.plan.weights_identity import WeightsChanged, weights_identity
from orchestrator.state.batch_files import RunDirUnreachable
from orchestrator.state.results import BatchWork, Completed, Failed
from orchestrator.slices.slice import SliceSpec, SliceWorker

N = 2  # samples per prompt


ENGINE = EngineConfig(page_size=8, max_pages=96, max_seqs=8, max_seqs_in_prefill=4, max_prefill_size=128,
                      max_seq_len=128)


def worker(model: str, **spec) -> SliceWorker:
    w = SliceWorker(SliceSpec("slice-t", model, model, "float32", ENGINE, SamplingConfig(max_new_tokens=12, n=N),
                              **spec))
    w.start()
    return w


def batch(directory: Path, batch_id: str, seq: int, num_prompts: int, wake_at: int | None = None) -> BatchWork:
    """A reference to a batch file written here (in the plan's schema), as the head sends it."""
    prompts = pa.table({"prompt_id": [f"{batch_id}-{i}" for i in range(num_prompts)],
                        "row": list(range(num_prompts)),
                        "token_ids": [[5 + i, 6, 7, 8 + seq] for i in range(num_prompts)],
                        "passthrough": [None] * num_prompts, "sampling": [None] * num_prompts,
                        "continuations": [None] * num_prompts}, schema=BATCH_SCHEMA)
    path = directory / f"{batch_id}.parquet"
    pq.write_table(prompts, path)
    return BatchWork(batch_id, 1, str(path), num_prompts, seq=seq, wake_at=wake_at)


def poll_until_done(w: SliceWorker, batch_ids: set[str]) -> tuple[list, int]:
    got, finished = [], 0
    while {r.batch_id for r in got} != batch_ids:
        results, _, finished = w.poll(timeout_s=60)
        got += results
    return got, finished


@pytest.mark.parametrize("wake_at", [None, 2 * N])
def test_a_slice_at_its_budget_answers_the_poll_with_its_results(run_model, tmp_path, wake_at):
    """Holding as many unfinished samples as the head allows (it wants its poll back only once every sample has
    finished, or never early), the head's poll comes back with the batch's results, every sample finished."""
    w = worker(run_model)
    try:
        w.submit(batch(tmp_path, "b0", 0, 2, wake_at=wake_at))
        results, _, finished = w.poll(timeout_s=60)
        assert [r.batch_id for r in results] == ["b0"] and isinstance(results[0], Completed)
        assert finished == 2 * N
    finally:
        w.stop()


def test_a_slice_below_its_budget_wakes_the_head_once_per_batch(run_model, tmp_path):
    """Below the head's budget (100 samples: the head wants its poll back as soon as any room is left) the poll
    returns at the batch's first step, with no result yet, so that the head sends the next batch while this one
    runs; the count of finished samples ends at every sample sent."""
    budget = 100
    w = worker(run_model)
    wakes = []
    put = w._outbox.put
    w._outbox.put = lambda item: (wakes.append(item) if item is None else None, put(item))
    try:
        w.submit(batch(tmp_path, "b0", 0, 2, wake_at=2 * N - budget + 1))
        results, steps, finished = w.poll(timeout_s=60)
        assert results == [] and steps >= 1 and finished < 2 * N
        w.submit(batch(tmp_path, "b1", 1, 3, wake_at=5 * N - budget + 1))
        got, finished = poll_until_done(w, {"b0", "b1"})
        assert finished == 5 * N
        assert len(wakes) == 2  # one wake for each batch received, none more
    finally:
        w.stop()


def test_the_slice_reads_its_batch_file_and_a_missing_one_fails_that_batch_once(run_model, tmp_path):
    """The head sends a reference: the slice reads the prompts itself. A batch whose file is gone fails at once,
    deterministically (the head never retries it), naming the file and the fix; the next batch runs."""
    w = worker(run_model)
    try:
        gone, ok = batch(tmp_path, "b0", 0, 2), batch(tmp_path, "b1", 1, 2)
        Path(gone.path).unlink()
        w.submit(gone)
        w.submit(ok)
        got, finished = poll_until_done(w, {"b0", "b1"})
        by_id = {r.batch_id: r for r in got}
        assert isinstance(by_id["b0"], Failed) and by_id["b0"].deterministic
        assert f"{gone.path} is missing" in by_id["b0"].error and "re-plan" in by_id["b0"].error
        assert isinstance(by_id["b1"], Completed) and by_id["b1"].samples.num_rows == 2 * N
        assert finished == 4 * N  # the failed batch's samples count as finished: the head's budget frees up
    finally:
        w.stop()


def test_a_host_that_cannot_see_the_run_directory_fails_its_start(tmp_path):
    """Slices read their batches from the run directory: a host that cannot see it is a configuration error
    (fatal at the head: not retried), found before the model loads."""
    spec = SliceSpec("slice-t", "no-model", "no-model", "float32", ENGINE, SamplingConfig(n=N),
                     batches_dir=str(tmp_path / "elsewhere" / "batches"))
    with pytest.raises(RunDirUnreachable, match="cannot see .*elsewhere/batches.*gs://"):
        SliceWorker(spec).start()


def test_a_slice_refuses_weights_changed_since_planning_before_it_loads_them(run_model, tmp_path):
    """Each host checks the checkpoint against run.json's record of the weight files (the head sends it)."""
    model = Path(shutil.copytree(run_model, tmp_path / "model"))
    recorded = weights_identity(str(model))
    path = model / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 1  # same size, same header
    path.write_bytes(bytes(data))
    spec = SliceSpec("slice-t", str(model), str(model), "float32", ENGINE, SamplingConfig(n=N), weights=recorded)
    with pytest.raises(WeightsChanged, match=r"model\.safetensors changed since the run was planned"):
        SliceWorker(spec).start()


def test_the_timeline_splits_every_step_into_device_calls_and_host_work(run_model, tmp_path):
    """Each bucket of the timeline a result carries holds its steps' time in device calls and in host work,
    taken from the engine's stats before they are cleared: every step counted once, none twice."""
    w = worker(run_model)
    try:
        t = time.perf_counter()
        w.submit(batch(tmp_path, "b0", 0, 3))
        w.submit(batch(tmp_path, "b1", 1, 3))
        got, _ = poll_until_done(w, {"b0", "b1"})
        wall = time.perf_counter() - t
        buckets = [b for r in got for b in r.timeline]
        assert sum(b["steps"] for b in buckets) == w.steps
        for b in buckets:
            assert b["device_s"] > 0 and b["host_s"] >= 0, b
        assert sum(b["device_s"] + b["host_s"] for b in buckets) <= wall
        assert w.engine.stats.step_s == []  # cleared at the last bucket's close: a days-long run stays flat
    finally:
        w.stop()


def test_the_timeline_carries_the_transfer_counters_and_the_tokens_they_served(run_model, tmp_path):
    """Each bucket carries the bytes its steps moved, by category (those that moved any), and the tokens they
    drew; summed over the buckets, they are every device call's bytes and every step's tokens."""
    from engine import transfer_summary
    from orchestrator.observe.timeline import transfers

    w = worker(run_model)
    moved = {"d2h": {}, "h2d": {}, "tokens": 0}
    ledger, step = w.engine.runner.transfers, w.engine.step
    end_call = ledger.end_call

    def counted_end_call():
        d2h, h2d = end_call()
        for key, counts in (("d2h", d2h), ("h2d", h2d)):
            for c, n in counts.items():
                moved[key][c] = moved[key].get(c, 0) + n
        return d2h, h2d

    def counted_step():
        done = step()
        moved["tokens"] += w.engine.stats.decode_tokens[-1]
        return done

    ledger.end_call, w.engine.step = counted_end_call, counted_step
    try:
        w.submit(batch(tmp_path, "b0", 0, 3))
        got, _ = poll_until_done(w, {"b0"})
        buckets = [b for r in got for b in r.timeline]
        assert sum(b["steps"] for b in buckets) == w.steps > 0
        assert transfers(buckets) == transfer_summary(moved["d2h"], moved["h2d"], moved["tokens"])
        assert sum(b["decode_tokens"] for b in buckets) == moved["tokens"] > 0 and moved["d2h"]["tokens"] > 0
        assert not any("device_to_host_bytes_swap" in b for b in buckets)  # only the categories that moved bytes
    finally:
        w.stop()


def test_the_timeline_carries_the_prefix_cache_counters(run_model, tmp_path):
    """The counters the engine's cache records reach the timeline, every step's once (recorded here per step)."""
    w = worker(run_model)
    step, stats, added = w.engine.step, w.engine.stats, []

    def counted_step():
        before = stats.prefix_cache_query_tokens, stats.prefix_cache_hit_tokens
        out = step()
        added.append((stats.prefix_cache_query_tokens - before[0], stats.prefix_cache_hit_tokens - before[1]))
        return out

    w.engine.step = counted_step
    try:
        w.submit(batch(tmp_path, "b0", 0, 3))
        got, _ = poll_until_done(w, {"b0"})
        buckets = [b for r in got for b in r.timeline]
        steps = sum(b["steps"] for b in buckets)
        assert steps == w.steps == len(added) > 0
        assert sum(b["prefix_cache_query_tokens"] for b in buckets) == sum(q for q, _ in added) > 0
        assert sum(b["prefix_cache_hit_tokens"] for b in buckets) == sum(h for _, h in added)
    finally:
        w.stop()
