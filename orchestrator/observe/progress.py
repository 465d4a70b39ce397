"""The head's live figures: a progress bar or plain progress lines, progress.json (the session's figures, read by
`status` and the run's summary: run_summary.py), the timeline as slices report it."""

from __future__ import annotations

import os
import socket
import sys
import time

from orchestrator.json_out import dumps
from orchestrator.observe.run_summary import eta_s
from orchestrator.state.manifest import BatchRecord
from orchestrator.state.rundir import RunDir
from orchestrator.storage import object_append
from orchestrator.storage.atomic import atomic_write_text

PROGRESS_EVERY_S = 5.0
LINE_EVERY_ENV = "PAGEFLEET_PROGRESS_EVERY_S"
LINE_EVERY_S = 30.0
"""Seconds between plain progress lines when stderr is not a terminal (`PAGEFLEET_PROGRESS_EVERY_S` overrides)."""


def per_s(count: int, seconds: float) -> float:
    """A session's rate: `count` over its wall time."""
    return count / max(seconds, 1e-9)


def line_every_s() -> float:
    value = os.environ.get(LINE_EVERY_ENV, "").strip()
    try:
        return max(0.1, float(value)) if value else LINE_EVERY_S
    except ValueError:
        raise ValueError(f"{LINE_EVERY_ENV}={value!r} is not a number of seconds") from None


class RunProgress:
    """Progress on stderr when `show` is true: a live bar on a terminal, else (a file, `ray job logs`) a plain
    line every `line_every_s()` seconds, never carriage-return bars."""

    def __init__(self, run_dir: RunDir, totals: dict, show: bool, stream=None) -> None:
        """`totals`: the manifest's as the session starts (manifest_totals)."""
        from tqdm import tqdm

        stream = stream or sys.stderr
        show_bar = show and stream.isatty()
        self._stream = stream
        self._lines = show and not show_bar
        self._line_every_s = line_every_s()
        self._next_line = time.monotonic() + self._line_every_s
        self.waiting: str | None = None
        """Why slices have not started (resources the cluster lacks), shown in the lines and progress.json."""
        self.batches_done = totals["counts"]["done"]
        self.batches_failed = 0

        self.run_dir = run_dir
        self.started = time.time()
        self.total_prompts = totals["prompts"]
        self.total_batches = sum(totals["counts"].values())
        self.session_prompts = 0
        self.session_tokens = 0
        self.session_batches = 0
        self._first_done: tuple[float, int] | None = None
        """(time, session prompts) when this session's first batch finished: the ETA's rate starts there."""
        self._last_write = 0.0
        self.session: dict | None = None
        """The session's figures last built for progress.json (the run's summary reads them: run_summary.py)."""
        self.bar = tqdm(total=self.total_prompts, initial=totals["prompts_done"], unit="prompt",
                        desc="prompts", file=stream, disable=not show_bar, dynamic_ncols=True, smoothing=0.1)
        self._timeline = object_append.open_append(run_dir.timeline)  # local file, or rewritten whole on gs://

    def batch_done(self, record: BatchRecord, num_done_batches: int, num_failed: int) -> None:
        self.session_prompts += record.num_prompts
        if self._first_done is None:
            self._first_done = (time.time(), self.session_prompts)
        self.session_tokens += record.num_output_tokens
        self.session_batches += 1
        self.batches_done, self.batches_failed = num_done_batches, num_failed
        self.bar.update(record.num_prompts)
        self.bar.set_postfix_str(f"batches {num_done_batches}/{self.total_batches}, "
                                 f"{self.tokens_per_s:,.0f} tok/s, failed {num_failed}", refresh=False)

    def add_timeline(self, slice_name: str, buckets: list[dict]) -> None:
        for b in buckets:  # an engine of a data-parallel slice is a line of its own: "slice-0/1"
            name = slice_name if "engine" not in b else f"{slice_name}/{b['engine']}"
            self._timeline.write(dumps({**b, "slice": name, "session": self.started}) + "\n")
        if buckets:
            self._timeline.flush()

    @property
    def elapsed_s(self) -> float:
        return time.time() - self.started

    @property
    def tokens_per_s(self) -> float:
        return per_s(self.session_tokens, self.elapsed_s)

    def eta_s(self, remaining_prompts: int) -> float | None:
        """Seconds left at this session's rate since its first batch finished: the start-up before it (Ray, slices
        loading the model, compiling) is not repeated, so counting it would inflate the ETA of a short or resumed
        run many times over. None until a batch after the first has finished."""
        if self._first_done is None:
            return None
        since, prompts = self._first_done
        return eta_s(remaining_prompts, per_s(self.session_prompts - prompts, time.time() - since))

    def line(self, remaining_prompts: int) -> str:
        """One plain progress line: prompts and batches done, tokens/s, ETA (and what slices wait for)."""
        done = self.total_prompts - remaining_prompts
        eta = self.eta_s(remaining_prompts)
        text = (f"progress: {done:,}/{self.total_prompts:,} prompts ({done / max(self.total_prompts, 1):.1%}), "
                f"batches {self.batches_done:,}/{self.total_batches:,} done, {self.batches_failed:,} failed, "
                f"{self.tokens_per_s:,.1f} tokens/s, ETA " + (f"{eta / 60:,.1f} min" if eta is not None else "unknown"))
        return text + (f"; {self.waiting}" if self.waiting else "")

    def write(self, remaining_prompts: int, force: bool = False, running: bool = True, fault: str | None = None) -> None:
        """Replace progress.json (every PROGRESS_EVERY_S, or now when forced); print a plain line when due, and
        always for the last write of a session (`running` false), so that a log ends with where the run stands.
        `fault`: with the last write, the fault the session stopped on (`pagefleet status` shows it)."""
        if self._lines and (time.monotonic() >= self._next_line or not running):
            self._next_line = time.monotonic() + self._line_every_s
            print(self.line(remaining_prompts), file=self._stream, flush=True)
        if not force and time.monotonic() - self._last_write < PROGRESS_EVERY_S:
            return
        self._last_write = time.monotonic()
        elapsed_s = self.elapsed_s  # one instant: the rates are this session's tokens and prompts over it
        prompts_per_s = per_s(self.session_prompts, elapsed_s)
        self.session = {
            "updated_at": time.time(), "head": {"pid": os.getpid(), "host": socket.gethostname()},
            "running": running, "session_started_at": self.started, "session_elapsed_s": elapsed_s,
            "session_batches": self.session_batches, "session_prompts": self.session_prompts,
            "session_output_tokens": self.session_tokens, "tokens_per_s": per_s(self.session_tokens, elapsed_s),
            "prompts_per_s": prompts_per_s, "eta_s": self.eta_s(remaining_prompts),
            "waiting": self.waiting if running else None,
            "fault": None if running else fault,
        }
        atomic_write_text(self.run_dir.progress, dumps(self.session, indent=1) + "\n")

    def close(self) -> None:
        self.bar.close()
        self._timeline.close()
