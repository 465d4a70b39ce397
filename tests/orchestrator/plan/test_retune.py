"""Resuming with other engine capacities: the plan stays, pending batches are re-packed when they no longer fit."""

import threading

import pytest

from orchestrator.config import load_run_config
from orchestrator.run.driver import Driver
from orchestrator.state.manifest import read_manifest
from orchestrator.state.run_state import RunState
from orchestrator.state.rundir import PlanMismatch

from ..conftest import run_args, write_run_corpus
from ..run.test_driver import reference, samples

pytestmark = pytest.mark.ray


def test_resume_with_fewer_slots_repacks_pending_batches_exactly_once(ray_local, run_model, tmp_path, monkeypatch,
                                                                     capsys):
    corpus = write_run_corpus(tmp_path / "corpus.jsonl", 24, seed=3)
    run_dir = tmp_path / "run"
    cfg = load_run_config(None, run_args(run_model, corpus, run_dir, "--cluster.num_slices=1"))

    # A run stopped once its first batch is done (as Ctrl-C would): some batches done, the rest pending.
    stop = threading.Event()
    real = RunState.mark_done
    monkeypatch.setattr(RunState, "mark_done", lambda self, *a, **k: (real(self, *a, **k), stop.set())[0])
    assert Driver(cfg, show_progress=False, stop=stop).run().exit_code == 130
    monkeypatch.undo()
    first = read_manifest(run_dir / "batches.jsonl")
    done = {r.batch_id for r in first if r.status == "done"}
    assert done and len(done) < len(first) and max(r.num_prompts for r in first) > 4
    stamps = {b: (run_dir / "outputs" / f"{b}.parquet").stat().st_mtime_ns for b in done}

    # `--engine.max_seqs=4` on the planned run: not refused; the pending prompts re-packed into batches of <= 4.
    retuned = load_run_config(None, run_args(run_model, corpus, run_dir, "--cluster.num_slices=1",
                                             "--engine.max_seqs=4"))
    capsys.readouterr()
    outcome = Driver(retuned, show_progress=False).run()
    assert outcome.exit_code == 0
    assert "prompts were re-packed into" in capsys.readouterr().out  # on the console, not only in events.log
    records = read_manifest(run_dir / "batches.jsonl")
    assert all(r.status == "done" for r in records)
    assert {r.batch_id for r in records} >= done  # done batches kept, not recomputed
    assert {b: (run_dir / "outputs" / f"{b}.parquet").stat().st_mtime_ns for b in done} == stamps
    new = [r for r in records if r.batch_id not in done]
    assert new and all(r.batch_id.endswith("-r1") and r.num_prompts <= 4 for r in new)
    assert sum(r.num_prompts for r in records) == 24
    got = samples(run_dir)  # every (prompt, generation) exactly once
    assert len(got) == 24 and got == reference(run_model, run_dir, retuned)  # and the same samples
    assert "re-packed" in (run_dir / "events.log").read_text()

    # Capacities are retunable; sample-changing keys are still refused.
    with pytest.raises(PlanMismatch, match="sampling.max_new_tokens"):
        Driver(load_run_config(None, run_args(run_model, corpus, run_dir, "--sampling.max_new_tokens=5")),
               show_progress=False).run()


def test_a_plan_from_before_retuning_compares_only_sample_keys():
    from orchestrator.config import RunConfig, plan_changes

    cfg = RunConfig()
    old = {**cfg.sample_affecting(), "packing": {"page_budget": None}}
    old["engine"] = {**old["engine"], "max_seqs": 16, "max_pages": 4}  # capacities, as older run.json kept them
    assert plan_changes(old, cfg) == []
    old["engine"]["max_seq_len"] = 64
    assert plan_changes(old, cfg) == [f"engine.max_seq_len: 64 -> {cfg.engine.max_seq_len!r}"]
