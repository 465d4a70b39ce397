"""The head's progress on stderr: a bar on a terminal, plain lines elsewhere (files, `ray job logs`)."""

import io
import re

import pytest

from orchestrator.state.manifest import BatchRecord, manifest_totals
from orchestrator.observe.progress import RunProgress
from orchestrator.state.rundir import RunDir


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def records() -> dict:
    """manifest_totals of four batches of 10 prompts, the first done."""
    return manifest_totals([BatchRecord(f"b{i}", status="done" if i == 0 else "pending", num_prompts=10)
                            for i in range(4)])


def test_off_a_terminal_progress_is_plain_lines(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEFLEET_PROGRESS_EVERY_S", "0.1")
    stream = io.StringIO()
    progress = RunProgress(RunDir(tmp_path), records(), show=True, stream=stream)
    progress.batch_done(BatchRecord("b1", status="done", num_prompts=10, num_output_tokens=100), 2, 0)
    progress._next_line = 0.0  # due now
    progress.waiting = "2 of 4 slices wait for resources"
    progress.write(20)
    progress.close()
    out = stream.getvalue()
    assert "\r" not in out
    line = out.strip()
    assert line.startswith("progress: 20/40 prompts (50.0%), batches 2/4 done, 0 failed")
    assert line.endswith("; 2 of 4 slices wait for resources")


def test_a_log_ends_with_where_the_run_stands(tmp_path):
    """The last write of a session prints its line whenever it comes: a run shorter than the line interval (30 s
    by default) still leaves one line in `ray job logs`, and a longer one ends at its final state."""
    stream = io.StringIO()
    progress = RunProgress(RunDir(tmp_path), records(), show=True, stream=stream)
    progress.write(30)  # not due: no line
    assert stream.getvalue() == ""
    progress.write(0, force=True, running=False)
    progress.close()
    assert stream.getvalue().startswith("progress: 40/40 prompts (100.0%)"), stream.getvalue()


def test_on_a_terminal_progress_is_a_bar_and_no_lines(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEFLEET_PROGRESS_EVERY_S", "0.1")
    stream = Terminal()
    progress = RunProgress(RunDir(tmp_path), records(), show=True, stream=stream)
    progress._next_line = 0.0
    progress.write(30)
    progress.close()
    assert "progress:" not in stream.getvalue() and "prompts" in stream.getvalue()


@pytest.mark.ray
def test_a_run_into_a_file_prints_progress_lines_and_the_slices_it_waits_for(run_in_own_process):
    """`pagefleet run` with stderr in a file (as under `ray job submit`), PAGEFLEET_PROGRESS=1 as before: plain
    lines, no carriage-return bars; four slices on a two-CPU Ray: it says two wait, and for what. (The run is
    tests/orchestrator/conftest.py's `run_in_own_process`.)"""
    text = run_in_own_process["stderr"]
    assert run_in_own_process["returncode"] == 0, text[-3000:]
    assert "\r" not in text
    assert sum(line.startswith("progress: ") for line in text.splitlines()) >= 2, text[-3000:]
    # How many of the two that fit have started when a line is printed depends on the machine's speed.
    assert re.search(r"2 of 4 slices wait for resources the cluster does not have \([0-2] started\): a slice needs "
                     r"CPU 1, the cluster has CPU 2 in all", text), text[-3000:]
    events = (run_in_own_process["run_dir"] / "events.log").read_text()
    assert "slices wait for resources the cluster does not have" in events


def test_the_eta_leaves_out_the_sessions_start_up(tmp_path):
    """A resumed run spends its first minute starting Ray and compiling; an ETA over the whole session's time
    said 105 min for a run that took 1.5. The rate starts when the session's first batch finishes."""
    import time

    progress = RunProgress(RunDir(tmp_path), records(), show=False)
    progress.started = time.time() - 100  # 100 s of start-up
    assert progress.eta_s(30) is None
    progress.batch_done(BatchRecord("b1", status="done", num_prompts=10, num_output_tokens=100), 2, 0)
    progress._first_done = (time.time() - 2, 10)  # the first batch finished 2 s ago; the next one now
    progress.batch_done(BatchRecord("b2", status="done", num_prompts=10, num_output_tokens=100), 3, 0)
    assert progress.eta_s(10) == pytest.approx(2, rel=0.2)  # 10 prompts at 5/s (not 20 prompts over 100 s)
    progress.close()
