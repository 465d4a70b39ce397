"""Test-wide environment: CPU JAX with 4 host devices (set before JAX is first imported)."""

import os

import pytest

# The Cloud Storage emulator fixtures (gcs_emulator, gcs_bucket) for the gs:// tests.
pytest_plugins = ["tests.gcs_emulator"]

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One persistent XLA compilation cache for the whole session, shared by every process it starts (pytest-xdist's
# workers, which inherit it from the controller, slice actors, `pagefleet run` subprocesses): the same step programs
# compile once, not once per process. The process that made it removes it at the end (the controller).
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import tempfile

    _CACHE_DIR = tempfile.mkdtemp(prefix="pagefleet-xla-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE_DIR
# Caches a test run fills (a gs:// model's tokenizer files) stay out of the home directory.
import tempfile as _tempfile

_XDG_CACHE = _tempfile.mkdtemp(prefix="pagefleet-test-cache-")
os.environ["XDG_CACHE_HOME"] = _XDG_CACHE


# Every XLA:CPU executable maps its code and data as a few memory regions, and JAX's jit caches keep every program
# a test compiled alive. A pytest process that compiles for hundreds of engine settings passed the kernel's
# vm.max_map_count (65,530) after about 40% of the suite, and XLA segfaulted in its next compile or cache write
# (test_engine.py alone passes 40,000). So after any test that leaves the process past a third of the limit,
# the compiled programs are dropped (later tests compile again, or load from the persistent cache); a test
# after which dropping them does not bring the count under half of the limit fails, naming the cause.
CLEAR_AT, FAIL_AT = 1 / 3, 1 / 2


def _memory_maps() -> tuple[int, int] | None:
    try:
        with open("/proc/self/maps") as maps, open("/proc/sys/vm/max_map_count") as limit:
            return sum(1 for _ in maps), int(limit.read())
    except OSError:  # not Linux
        return None


@pytest.fixture(autouse=True)
def _bounded_compiled_programs():
    yield
    counts = _memory_maps()
    if counts is None or counts[0] <= CLEAR_AT * counts[1]:
        return
    import gc

    import jax

    jax.clear_caches()
    gc.collect()
    counts = _memory_maps()
    if counts[0] > FAIL_AT * counts[1]:
        pytest.fail(f"the test process holds {counts[0]} memory maps (vm.max_map_count {counts[1]}) after "
                    "jax.clear_caches(): something keeps compiled programs alive")


def pytest_sessionfinish(session, exitstatus):
    import shutil

    shutil.rmtree(_XDG_CACHE, ignore_errors=True)
    if "_CACHE_DIR" in globals():
        shutil.rmtree(_CACHE_DIR, ignore_errors=True)
