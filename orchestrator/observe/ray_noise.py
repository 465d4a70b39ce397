"""Ray's routine notices, kept off the head's console; its warnings and errors still come through.

Ray Data logs, for every dataset the planner runs, an INFO line when execution finishes and, once per
process, a WARNING that progress bars are off (the planner turns them off on purpose: the capacity
report is its output). Both read as faults to a user. Only those two loggers change, and only below
WARNING, or that one notice: a real failure (an exception, a WARNING about resources) is untouched.
"""

from __future__ import annotations

import logging

EXECUTOR_LOGGER = "ray.data._internal.execution.streaming_executor"
PROGRESS_LOGGER = "ray.data._internal.progress"
NOTICES = ("Progress bars disabled", "Progress bars for operators disabled",
           "Progress will be logged because stdout is a non-interactive terminal")


class _DropNotices(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR or not record.getMessage().startswith(NOTICES)


def quiet_ray_data() -> None:
    """Drop Ray Data's per-dataset INFO lines and its progress-bar notices in this process (idempotent)."""
    logging.getLogger(EXECUTOR_LOGGER).setLevel(logging.WARNING)
    progress = logging.getLogger(PROGRESS_LOGGER)
    if not any(isinstance(f, _DropNotices) for f in progress.filters):
        progress.addFilter(_DropNotices())
