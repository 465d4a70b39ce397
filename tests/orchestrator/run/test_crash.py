"""Crash safety: `pagefleet run` SIGKILLed at named points, then rerun, loses, duplicates and recomputes nothing.

Each chain runs the real command in a subprocess (its own local Ray), kills it at one point after
another (`PAGEFLEET_CRASH_AT`, see orchestrator/state/faults.py), checks the run directory after each kill,
and finally lets it finish; the export must equal an uninterrupted run's, field for field.
"""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.config import load_run_config
from orchestrator.run.driver import Driver
from orchestrator.export.export import collect
from orchestrator.state.manifest import read_manifest

from ..conftest import run_args, write_run_corpus

pytestmark = pytest.mark.ray
ROOT = Path(__file__).resolve().parents[3]


def pagefleet_run(config: Path, args: list[str], crash_at: str | None) -> int:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "PAGEFLEET_CRASH_AT")}
    if crash_at:
        env["PAGEFLEET_CRASH_AT"] = crash_at
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator", "run", str(config), *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    out, _ = proc.communicate(timeout=600)
    try:  # the killed head's local Ray (raylet, agents, slice workers) goes with it, as when a machine dies
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    if proc.returncode not in (0, -signal.SIGKILL):
        raise AssertionError(f"pagefleet run exited {proc.returncode}:\n{out.decode()[-4000:]}")
    return proc.returncode


def done_outputs(run_dir: Path) -> dict[str, tuple[int, int]]:
    """Batches marked done -> (inode, mtime_ns) of their output file."""
    out = {}
    for r in read_manifest(run_dir / "batches.jsonl"):
        if r.status == "done":
            st = (run_dir / r.output).stat()
            out[r.batch_id] = (st.st_ino, st.st_mtime_ns)
    return out


def records(run_dir: Path) -> list[dict]:
    rows = collect(run_dir).to_pylist()
    keys = [(r["prompt_id"], r["generation_index"]) for r in rows]
    assert len(set(keys)) == len(keys), "a sample appears twice"
    return rows


# Each point must be reached however fast the engine is: a point counted in batches (output_*, dispatched)
# needs batches left to run, so it comes before any point counted in manifest writes, which are at least a
# second apart (RunState.flush_interval_s) and so may come only with the last batch done; manifest_written:2
# (reached a second into its run, or at once after a recovery's write) leaves manifest_tmp:3 batches to run.
# Every `pagefleet run` costs ~15 s on 2 cores (Python, its own Ray, the plan's workers, two slices), so the
# default run has one chain through every point, seeded (n=2, logprobs) on two slices; the greedy chain of
# fewer points (temperature 0, no logprobs: nothing the seeded chain's resume does not also prove) is slow-only.
@pytest.mark.parametrize("mode, points", [
    pytest.param("greedy", ["planned", "dispatched:2", "output_tmp", "output_written:2", "manifest_tmp:3"],
                 marks=pytest.mark.slow),
    ("seeded", ["planned", "dispatched:2", "output_tmp", "output_written:2", "manifest_written:2", "manifest_tmp:3"]),
])
def test_killed_head_resumes_without_loss_duplication_or_recompute(ray_local, run_model, tmp_path, mode, points):
    corpus = write_run_corpus(tmp_path / "corpus.jsonl", 40, seed=7)
    extra = ["--packing.max_prefill_steps=1"]  # at most 4 prompts a batch: many batches, many crash points
    if mode == "seeded":
        extra += ["--sampling.temperature=0.9", "--sampling.top_p=0.95", "--sampling.n=2", "--sampling.seed=3",
                  "--sampling.logprobs=true"]
    config = tmp_path / "run.yaml"
    config.write_text("name: crash\n")

    baseline_dir = tmp_path / "uninterrupted"
    cfg = load_run_config(config, run_args(run_model, corpus, baseline_dir, *extra))
    assert Driver(cfg, show_progress=False).run().exit_code == 0
    expected = records(baseline_dir)

    run_dir = tmp_path / "crashed"
    args = run_args(run_model, corpus, run_dir, *extra)
    done_before: dict[str, tuple[int, int]] = {}
    for point in points + [None]:
        events_before = (run_dir / "events.log").read_text().count("\n") if (run_dir / "events.log").exists() else 0
        code = pagefleet_run(config, args, point)
        assert code == (0 if point is None else -signal.SIGKILL), f"the run was not killed at {point}"
        now = done_outputs(run_dir) if (run_dir / "batches.jsonl").exists() else {}
        # A batch marked done before this invocation was neither recomputed nor rewritten.
        for batch_id, stamp in done_before.items():
            assert now.get(batch_id) == stamp, f"{batch_id} was recomputed after the kill at {point}"
        started = [line.split()[1] for line in (run_dir / "events.log").read_text().splitlines()[events_before:]
                   if " running on " in line]
        assert not set(started) & set(done_before), f"done batches were dispatched again: {set(started) & set(done_before)}"
        done_before = now
    assert not list(run_dir.glob(".*.tmp")) and not list((run_dir / "outputs").glob(".*.tmp"))
    assert all(r.status == "done" for r in read_manifest(run_dir / "batches.jsonl"))
    got = records(run_dir)
    assert len(got) == len(expected)
    # Every field identical, logprobs to the bit: the steps that computed them differ between the two runs (which
    # batches shared the engine depends on timing and on the kills), and a row's bits do not depend on the rows
    # beside it (engine/device/row_tiles.py).
    assert all((r["logprobs"] is None) == (mode == "greedy") for r in got + expected)
    assert got == expected
    assert json.loads((run_dir / "run.json").read_text())["fingerprints"] == \
        json.loads((baseline_dir / "run.json").read_text())["fingerprints"]
