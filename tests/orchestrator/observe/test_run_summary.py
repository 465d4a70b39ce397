"""One RunSummary: the run's summary (`pagefleet run`, RunOutcome.summary), W&B's run summary and `pagefleet status`
(text and --json) give the same value for every figure they share, each under the names its users read."""

import json
from typing import Any

import pytest

from orchestrator import exit_codes
from orchestrator.commands.cli import main
from orchestrator.observe.run_summary import RunSummary
from orchestrator.observe.status import format_status, status
from orchestrator.state.lock import RunLock
from orchestrator.state.manifest import BatchRecord, write_manifest
from orchestrator.state.rundir import RunDir

from ..conftest import poison_batch, run_args, tracker_summaries, write_run_corpus

EARLIER = [  # an earlier session's timeline buckets, with every counter the figures sum
    {"t": 1.0, "steps": 3, "tokens_per_s": 1.0, "occupancy": 0.5, "device_s": 0.5, "host_s": 0.25, "slice": "slice-0",
     "prefix_cache_query_tokens": 300, "prefix_cache_hit_tokens": 200, "kv_pages_out": 6, "kv_pages_in": 4,
     "recompute_avoided_tokens": 90, "recompute_tokens": 5, "host_kv_pages_peak": 6, "decode_tokens": 40,
     "device_to_host_bytes_tokens": 1000, "host_to_device_bytes_step_inputs": 500, "programs_compiled": 3,
     "compile_s": 2.5, "programs_loaded": 0, "program_load_s": 0.0, "trace_lower_s": 0.75},
    {"t": 2.0, "steps": 1, "tokens_per_s": 2.0, "occupancy": 0.25, "device_s": 0.25, "host_s": 0.125, "slice": "slice-1",
     "prefix_cache_query_tokens": 100, "prefix_cache_hit_tokens": 100, "kv_pages_out": 2, "kv_pages_in": 4,
     "recompute_avoided_tokens": 30, "recompute_tokens": 0, "host_kv_pages_peak": 3, "decode_tokens": 10,
     "device_to_host_bytes_tokens": 250, "host_to_device_bytes_step_inputs": 125, "programs_compiled": 0,
     "compile_s": 0.0, "programs_loaded": 3, "program_load_s": 0.25, "trace_lower_s": 0.5},
]


def shared_figures(run: dict[str, Any], st: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(figure, the run summary's value, `status --json`'s value) for each figure both give, by the names each
    output has always used (docs/tracking.md, docs/run-directory.md)."""
    counts = st["counts"]
    pairs = [(k, run.get(k), st[k]) for k in ("run_dir", "batches", "prompts", "prompts_done", "rows_rejected",
                                              "samples_done", "tokens_per_s", "mean_occupancy")]
    pairs += [("batches_done", run["batches_done"], counts["done"]),
              ("batches_failed", run["batches_failed"], counts["failed"]),
              ("batches_pending", run["batches_pending"], counts["pending"] + counts["running"]),
              ("output_tokens", run["output_tokens"], st["output_tokens_done"]),
              ("engine_device_s", run.get("engine_device_s"), st["engine_time"]["device_s"]),
              ("engine_host_s", run.get("engine_host_s"), st["engine_time"]["host_s"]),
              ("failed", run["failed"], {f["batch_id"]: f["error"] for f in st["failed"]})]
    for group in ("prefix_cache", "preemption", "transfers", "programs"):
        pairs += [(k, run.get(k), v) for k, v in st[group].items()]
    return pairs


def assert_one_summary(run: dict[str, Any], tracked: dict[str, Any], st: dict[str, Any]) -> None:
    assert st["tokens_per_s"] is not None and st["mean_occupancy"] is not None  # every figure is there to compare
    assert st["engine_time"] and st["prefix_cache"] and st["preemption"] and st["transfers"] and st["programs"]
    differ = [(name, a, b) for name, a, b in shared_figures(run, st) if a != b]
    assert not differ, differ
    # W&B's summary: the run summary's figures that are numbers or text, nothing else (no batch's values).
    assert tracked == {k: v for k, v in run.items() if k != "failed"}


def write_run_dir(root) -> RunDir:
    write_manifest(root / "batches.jsonl", [
        BatchRecord("b0", status="done", num_prompts=4, num_samples=8, num_output_tokens=50, attempts=1),
        BatchRecord("b1", status="failed", num_prompts=3, attempts=2, error="Traceback\nValueError: boom"),
        BatchRecord("b2", status="pending", num_prompts=2),
        BatchRecord("b3", status="running", num_prompts=1, attempts=1)])
    (root / "run.json").write_text(json.dumps({"plan": {"rows_read": 12, "accepted": 10}, "fingerprints": {},
                                               "sample_affecting": {}}))
    (root / "progress.json").write_text(json.dumps({
        "updated_at": 1.0, "session_elapsed_s": 10.0, "session_batches": 1, "session_prompts": 4,
        "session_output_tokens": 50, "tokens_per_s": 5.0, "prompts_per_s": 0.4, "waiting": "1 of 2 slices wait"}))
    (root / "timeline.jsonl").write_text("".join(json.dumps(b) + "\n" for b in EARLIER))
    return RunDir(root)


def test_the_views_of_one_summary_agree(tmp_path):
    run_dir = write_run_dir(tmp_path)
    summary = RunSummary.read(run_dir)
    run = summary.run_figures()
    assert_one_summary(run, summary.tracker_figures(), status(tmp_path))
    assert (run["batches"], run["batches_pending"], run["rows_rejected"], run["output_tokens"]) == (4, 2, 2, 50)
    assert (run["session_s"], run["session_batches"], run["session_output_tokens"]) == (10.0, 1, 50)
    assert run["mean_occupancy"] == (0.5 * 3 + 0.25) / 4 and (run["engine_device_s"], run["engine_host_s"]) == (0.75, 0.375)
    assert run["kv_pages_out"] == 8 and run["device_to_host_bytes_per_token"] == 1250 / 50
    assert (run["programs_compiled"], run["programs_loaded"], run["compile_s"]) == (3, 3, 2.5)

    # ETA and what slices wait for: only while a head holds the run directory (6 prompts left at 0.4 prompts/s).
    assert status(tmp_path)["eta_s"] is None and status(tmp_path)["waiting"] is None
    with RunLock(tmp_path):
        held = status(tmp_path)
    assert held["eta_s"] == 6 / 0.4 and held["waiting"] == "1 of 2 slices wait"

    # The text outputs print the timeline's figures in the same words.
    printed, shown = summary.format_run(), format_status(status(tmp_path))
    for label in ("slot occupancy", "engine time", "prefix cache", "preemption", "transfers", "programs"):
        ours = next(line for line in printed.splitlines() if line.startswith(label))
        theirs = next(line for line in shown.splitlines() if line.startswith(label))
        assert ours[len(label):].strip() == theirs[len(label):].strip()
    assert "this run         1 batches, 50 tokens in 10.0 s = 5.0 tokens/s" in printed
    assert "failed b1: ValueError: boom" in printed

    # A head that ran no session (every batch already done) reports the run's totals, no session figures.
    quiet = RunSummary.read(run_dir, session=None).run_figures()
    assert quiet["session_s"] == 0.0 and "tokens_per_s" not in quiet and "session_batches" not in quiet


@pytest.mark.ray
def test_run_summary_wandb_summary_and_status_json_agree(ray_local, run_model, tmp_path, monkeypatch, capsys):
    """A real run with a failed batch and an earlier session's timeline: the driver's summary, the summary it gives
    the tracker (W&B's run summary) and `pagefleet status --json` agree exactly on every figure they share. (They
    were computed twice: the driver rounded tokens/s, occupancy and engine time, and took tokens/s at another
    instant than the one progress.json holds.)"""
    from orchestrator.config import load_run_config
    from orchestrator.plan.planner import plan
    from orchestrator.run.driver import Driver

    corpus = write_run_corpus(tmp_path / "corpus.jsonl", 16, seed=4)
    run_dir = tmp_path / "run"
    cfg = load_run_config(None, run_args(run_model, corpus, run_dir, "--cluster.num_slices=1"))
    plan(cfg)
    poison_batch(run_dir)  # b000001 fails at once
    (run_dir / "timeline.jsonl").write_text("".join(json.dumps(b) + "\n" for b in EARLIER))
    tracked = tracker_summaries(monkeypatch)

    outcome = Driver(cfg, show_progress=False).run()
    assert outcome.exit_code == exit_codes.BATCHES_FAILED and list(outcome.summary["failed"]) == ["b000001"]
    capsys.readouterr()
    assert main(["status", str(run_dir), "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert_one_summary(outcome.summary, tracked[0], st)
    assert outcome.summary["session_batches"] == outcome.summary["batches_done"] > 0
    # The slices' programs, on top of the earlier session's 3 compiled and 3 loaded: this session's slice compiled or
    # loaded its step programs (the test session's compile cache may hold them already).
    assert outcome.summary["programs_compiled"] + outcome.summary["programs_loaded"] > 6
