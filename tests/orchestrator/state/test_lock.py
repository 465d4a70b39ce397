"""orchestrator/state/lock.py: the refusal names the holder with a readable time."""

import os
import re

import pytest

from orchestrator.state.lock import RunDirLocked, RunLock, holder_text


def test_the_holder_is_named_with_a_utc_time_not_epoch_seconds(tmp_path):
    with RunLock(tmp_path / "run"):
        with pytest.raises(RunDirLocked) as refused:
            RunLock(tmp_path / "run").__enter__()
    message = str(refused.value)
    assert f'"pid": {os.getpid()}' in message
    assert re.search(r'"since": "\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC"', message), message


def test_holder_text_keeps_what_it_cannot_read():
    assert holder_text("  ") == "an unknown process"
    assert holder_text("not json") == "not json"
    assert holder_text('{"pid": 1, "since": 0}') == '{"pid": 1, "since": "1970-01-01 00:00:00 UTC"}'
