"""The run directory's lock on an object store (the Cloud Storage emulator), between separate processes."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from orchestrator.storage import storage
from orchestrator.state.lock import RunDirLocked
from orchestrator.state.object_lock import ObjectRunLock

HOLD = """
import sys, time
from orchestrator.state.object_lock import ObjectRunLock
with ObjectRunLock(sys.argv[1], stale_after_s=float(sys.argv[2]), refresh_s=float(sys.argv[3])) as lock:
    print("took over from " + str(lock.took_over_from) if lock.took_over_from else "locked", flush=True)
    time.sleep(float(sys.argv[4]))
"""


def head(run_dir: str, stale_after_s: float, refresh_s: float = 0.3, hold_s: float = 600) -> subprocess.Popen:
    """A separate process that takes the lock, says so on its first line, and holds it `hold_s`."""
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    return subprocess.Popen([sys.executable, "-c", HOLD, run_dir, str(stale_after_s), str(refresh_s), str(hold_s)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


@pytest.mark.slow  # four head processes and waits for staleness: about 10 s
def test_second_head_refused_while_held_then_takes_over_once_stale(gcs_bucket):
    run_dir = f"{gcs_bucket}/runs/a"
    first = head(run_dir, stale_after_s=3.0)
    try:
        assert first.stdout.readline().strip() == "locked"
        time.sleep(4)  # older than stale_after_s, but refreshed all along: still held
        second = head(run_dir, stale_after_s=3.0, hold_s=0)
        _, err = second.communicate(timeout=60)
        assert second.returncode != 0
        assert f"run directory {run_dir} is in use by" in err and f'"pid": {first.pid}' in err, err
    finally:
        first.send_signal(signal.SIGKILL)  # a head that is gone: its lock stays behind, no longer refreshed
        first.wait()
    assert json.loads(storage.read_bytes(f"{run_dir}/.lock"))["pid"] == first.pid
    refused = head(run_dir, stale_after_s=3.0, hold_s=0)  # right after the kill: not stale yet
    assert refused.communicate(timeout=60)[0] == "" and refused.returncode != 0
    time.sleep(3.5)
    third = head(run_dir, stale_after_s=3.0, hold_s=0)
    out, err = third.communicate(timeout=60)
    assert third.returncode == 0, err
    assert out.startswith("took over from") and f'"pid": {first.pid}' in out, out
    assert not storage.exists(f"{run_dir}/.lock")  # released on exit


@pytest.mark.slow  # three head processes: about 5 s
def test_two_heads_starting_at_once_one_wins(gcs_bucket):
    run_dir = f"{gcs_bucket}/runs/b"
    heads = [head(run_dir, stale_after_s=30.0, hold_s=3) for _ in range(3)]
    outs = [h.communicate(timeout=120) for h in heads]
    winners = [o for o, _ in outs if o.strip() == "locked"]
    assert len(winners) == 1, outs
    assert sum("is in use by" in e for _, e in outs) == 2, outs


def test_a_holder_that_stalled_and_was_taken_over_knows_it(gcs_bucket):
    run_dir = f"{gcs_bucket}/runs/c"
    stalled = ObjectRunLock(run_dir, stale_after_s=1.0, refresh_s=0.5)
    stalled.__enter__()
    stalled._stop.set()  # stalls: no more refreshes
    stalled._thread.join()
    time.sleep(1.5)
    with ObjectRunLock(run_dir, stale_after_s=1.0, refresh_s=0.5) as new:
        assert new.took_over_from and str(os.getpid()) in new.took_over_from
        stalled._stop.clear()  # wakes up and refreshes: its generation is gone
        stalled._thread = None
        stalled.refresh_s = 0.01
        import threading

        t = threading.Thread(target=stalled._refresh)
        t.start()
        time.sleep(0.3)
        stalled._stop.set()
        t.join()
        with pytest.raises(RunDirLocked, match="lost the lock .* another head took it over"):
            stalled.check()
        stalled.__exit__(None, None, None)  # must not delete the new holder's lock
        assert storage.exists(f"{run_dir}/.lock")
        new.check()


def test_a_holder_whose_lock_object_was_removed_knows_it(gcs_bucket):
    run_dir = f"{gcs_bucket}/runs/d"
    with ObjectRunLock(run_dir, stale_after_s=1.0, refresh_s=0.1) as lock:
        storage.remove(f"{run_dir}/.lock")  # by hand, or by a tool that should not have
        deadline = time.monotonic() + 10
        while lock.lost is None and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(RunDirLocked, match="lost the lock .*: its lock object was removed by another process"):
            lock.check()
    assert not storage.exists(f"{run_dir}/.lock")  # nothing written back on exit


def test_a_holder_that_cannot_refresh_stops_before_its_lock_can_go_stale(gcs_bucket, monkeypatch):
    run_dir = f"{gcs_bucket}/runs/e"
    with ObjectRunLock(run_dir, stale_after_s=1.0, refresh_s=0.1) as lock:
        def unreachable(*args, **kwargs):
            raise ConnectionError("the bucket does not answer")

        monkeypatch.setattr("orchestrator.storage.generations.replace_if_generation", unreachable)
        started = time.monotonic()
        while lock.lost is None and time.monotonic() - started < 10:
            time.sleep(0.05)
        assert time.monotonic() - started < 1.0 + 0.5, "it noticed only after another head could have taken over"
        with pytest.raises(RunDirLocked, match="could not be refreshed for .* s .*Check this machine's access"):
            lock.check()
        monkeypatch.undo()
