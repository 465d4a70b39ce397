"""Ray's routine notices, kept off the head's console; its warnings and errors still come through.

Ray Data logs, for every dataset the planner runs, an INFO line when execution finishes and, once per
process, a WARNING that progress bars are off (the planner turns them off on purpose: the capacity
report is its output). Both read as faults to a user. Only those two loggers change, and only below
WARNING, or that one notice: a real failure (an exception, a WARNING about resources) is untouched.

Two kinds of error record are kept off the console too, because the exception itself reaches pagefleet, which
reports it in one line (`PAGEFLEET_DEBUG=1` for the traceback; Ray's session log keeps everything): Ray Data's
"Exception occurred in Ray Data or Ray Core internal code" and its stack trace (logger `ray.data.exceptions`),
and the tracebacks its operators log for a full disk (pagefleet's line names the file and the recovery).
"""

from __future__ import annotations

import logging

from orchestrator.state.disk_full import disk_full

EXECUTOR_LOGGER = "ray.data._internal.execution.streaming_executor"
PROGRESS_LOGGER = "ray.data._internal.progress"
NOTICES = ("Progress bars disabled", "Progress bars for operators disabled",
           "Progress will be logged because stdout is a non-interactive terminal")


class _DropNotices(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR or not record.getMessage().startswith(NOTICES)


DATA_LOGGER = "ray.data"
EXCEPTIONS_LOGGER = "ray.data.exceptions"
FULL_DISK_TEXT = ("[Errno 28]", "[Errno 122]")  # ENOSPC, EDQUOT as an OSError prints them


class _DropReported(logging.Filter):
    """On the console handler of Ray Data's loggers: drops the errors pagefleet reports itself."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == EXCEPTIONS_LOGGER:
            return False
        if record.levelno < logging.ERROR:
            return True
        if record.exc_info and record.exc_info[1] is not None and disk_full(record.exc_info[1], "") is not None:
            return False
        return not any(text in record.getMessage() for text in FULL_DISK_TEXT)


def quiet_ray_data() -> None:
    """Drop Ray Data's per-dataset INFO lines and its progress-bar notices in this process (idempotent)."""
    logging.getLogger(EXECUTOR_LOGGER).setLevel(logging.WARNING)
    progress = logging.getLogger(PROGRESS_LOGGER)
    if not any(isinstance(f, _DropNotices) for f in progress.filters):
        progress.addFilter(_DropNotices())
    for handler in logging.getLogger(DATA_LOGGER).handlers:
        if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler) and \
                not any(isinstance(f, _DropReported) for f in handler.filters):
            handler.addFilter(_DropReported())
