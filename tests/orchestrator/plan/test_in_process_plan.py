"""A small corpus is planned in the head's own process, a large one by Ray tasks on the cluster: the same code on the
same shards, so the plan is the same either way (batch files, manifest, rejections), byte for byte, window by window."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from orchestrator.config import load_run_config
from orchestrator.plan import tokenized
from orchestrator.plan.planner import plan

ROOT = Path(__file__).resolve().parents[3]


def _corpus(path: Path) -> None:
    lines = [{"id": f"p{i}", "prompt": "word " * (1 + (i * 7) % 40)} for i in range(60)]
    lines += [{"id": "p3", "prompt": "a duplicate id"}, {"id": "bad"}, {"id": "shared", "prompt": "word " * 40}]
    lines += [{"id": f"s{i}", "prompt": "word " * (1 + i), "continuation": [" word"] * (1 + i % 3)} for i in range(6)]
    lines += [{"id": "ids", "prompt": "word", "continuation_token_ids": [[5, 6], [7]]}]  # scored rows
    path.write_text("".join(json.dumps(line) + "\n" for line in lines) + "not json\n")


def _plan_of(run_dir: Path) -> dict[str, object]:
    """Everything a plan writes that does not name its own config: batch files, manifest, rejections."""
    batches = {p.name: pq.read_table(p).to_pylist() for p in sorted((run_dir / "batches").glob("*.parquet"))}
    return {"batches": batches, "manifest": (run_dir / "batches.jsonl").read_text(),
            "rejected": (run_dir / "rejected.jsonl").read_text()}


def test_a_plan_made_here_equals_the_plan_made_on_the_cluster(tiny_model, tmp_path, monkeypatch, ray_local):
    corpus = tmp_path / "corpus.jsonl"
    _corpus(corpus)
    where, made = [], []
    real = tokenized.tokenize
    monkeypatch.setattr("orchestrator.plan.planner.tokenize",
                        lambda *args: where.append(args[-1] == 0) or made.append(real(*args)) or made[-1])
    results = {}
    for name, limit in (("here", 2**20), ("ray", 0)):
        cfg = load_run_config(None, [f"--name={name}", f"--run_dir={tmp_path / name}", f"--corpus.path={corpus}",
                                     f"--model.path={tiny_model}", "--engine.max_seqs=4", "--engine.max_pages=64",
                                     "--engine.page_size=4", "--sampling.max_new_tokens=4",
                                     "--corpus.shard_bytes=400", f"--corpus.in_process_bytes={limit}",
                                     "--corpus.window_rows=30"])  # three windows: p3 reused 57 rows later
        free = tokenized.free_cpus()  # 2 unless an earlier test's actor still holds a CPU
        plan(cfg)
        results[name] = _plan_of(tmp_path / name)
    assert where == [True] * 3 + [False] * 3  # one plan each way, three windows each
    # A tokenizer on each CPU free when planning starts (read after the row counts, Ray's lagging count gave one).
    assert free >= 2, f"only {free} CPU free in the test's Ray: an earlier test left an actor holding one"
    assert made[3].workers == free
    assert len(results["here"]["batches"]) > 1 and "duplicate_id" in results["here"]["rejected"]
    assert "expected_samples" in results["here"]["manifest"]  # the scored rows were planned
    assert results["here"] == results["ray"]


@pytest.mark.parametrize("in_process_bytes", [2**20, pytest.param(0, marks=pytest.mark.slow)], ids=["here", "cluster"])
def test_a_full_disk_while_planning_is_one_line_naming_the_file_and_a_rerun_plans(tiny_model, tmp_path,
                                                                                  in_process_bytes):
    """A full disk while a batch file is written: in the head, or in a Ray worker (whose error, under Ray Data, came
    back as Ray's HashShuffle traceback and `internal error`)."""
    corpus = tmp_path / "corpus.jsonl"
    _corpus(corpus)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "RAY_AUTH_MODE": "disabled",
           "PAGEFLEET_DISK_FULL_AT": "batch_file:2"}
    env.pop("RAY_ADDRESS", None)
    command = [sys.executable, "-m", "orchestrator", "plan", str(ROOT / "configs" / "demo.yaml"),
               f"--model.path={tiny_model}", f"--corpus.path={corpus}", f"--run_dir={tmp_path / 'run'}",
               "--engine.max_seqs=4", "--engine.page_size=4", "--sampling.max_new_tokens=4",
               f"--corpus.in_process_bytes={in_process_bytes}"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if line.startswith("pagefleet plan:")]
    assert len(lines) == 1 and "out of disk space writing" in lines[0] and str(tmp_path / "run") in lines[0], \
        done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "internal error" not in done.stderr, done.stderr[-3000:]
    env.pop("PAGEFLEET_DISK_FULL_AT")
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.parametrize("stage", ["count", "tokenize"])
def test_a_shard_that_fails_on_the_cluster_fails_the_plan_with_its_own_error_once(tiny_model, tmp_path, monkeypatch,
                                                                                  ray_local, stage):
    """A corpus file gone after it was listed, before its shards are counted or tokenized on the cluster: the plan
    raises the worker's own FileNotFoundError (one line naming the file, as the command prints it), and Ray prints no
    error of its own for the tasks' other results. The shards after the failure are not started (at most two tasks a
    CPU were submitted), and no task is cancelled: `ray.cancel` racing a task's reply aborted the head inside Ray
    (2.60) now and then."""
    import gc
    import logging
    import time

    import ray

    from orchestrator.plan import planner

    (tmp_path / "corpus").mkdir()
    for name, rows in (("a", 40), ("b", 400)):
        (tmp_path / "corpus" / f"{name}.jsonl").write_text("".join(
            json.dumps({"id": f"{name}{i}", "prompt": "word " * (1 + i % 9)}) + "\n" for i in range(rows)))
    before = {"count": "corpus_bytes", "tokenize": "count"}[stage]  # the step after which the file goes
    real = getattr(planner, before)

    def then_lose_a_file(*args):
        result = real(*args)
        (tmp_path / "corpus" / "a.jsonl").unlink()
        return result

    submitted, cancelled, real_remote = {}, [], ray.remote
    watched = {tokenized.count_rows: "count", tokenized.tokenize_on_worker: "tokenize"}

    def counting_remote(*args, **kwargs):
        def wrap(function):
            remote = real_remote(*args, **kwargs)(function)
            if function not in watched:
                return remote

            class Counted:
                def remote(self, *task_args):
                    submitted.setdefault(watched[function], []).append(task_args[0])
                    return remote.remote(*task_args)
            return Counted()
        return wrap

    monkeypatch.setattr(planner, before, then_lose_a_file)
    monkeypatch.setattr(ray, "remote", counting_remote)
    monkeypatch.setattr(ray, "cancel", lambda *args, **kwargs: cancelled.append(args))
    cfg = load_run_config(None, [f"--run_dir={tmp_path / 'run'}", f"--corpus.path={tmp_path / 'corpus'}",
                                 f"--model.path={tiny_model}", "--engine.max_seqs=4", "--engine.max_pages=64",
                                 "--engine.page_size=4", "--sampling.max_new_tokens=4", "--corpus.shard_bytes=400",
                                 "--corpus.in_process_bytes=0"])
    reported = []
    handler = logging.Handler()
    handler.emit = lambda record: reported.append(record.getMessage())
    ray_worker = logging.getLogger("ray._private.worker")  # where Ray reports an error nobody read
    ray_worker.addHandler(handler)
    try:
        with pytest.raises(FileNotFoundError) as e:
            plan(cfg)
        assert "a.jsonl" in str(e.value) and "\n" not in str(e.value), str(e.value)
        del e
        gc.collect()
        time.sleep(2)  # reported when the last reference to the error goes
    finally:
        ray_worker.removeHandler(handler)
    assert not [m for m in reported if "Unhandled error" in m], reported
    assert not cancelled
    # a.jsonl's shards come first (5 of 400 bytes); the local Ray has 2 CPUs: 4 tasks at a time, none after one fails
    failing = submitted[stage]
    assert len(failing) <= 4 and all(shard.file.endswith("a.jsonl") for shard in failing), failing
    assert ("tokenize" in submitted) == (stage == "tokenize")
