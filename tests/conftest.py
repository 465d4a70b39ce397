"""Test-wide environment: CPU JAX with 4 host devices (set before JAX is first imported)."""

import os

# The Cloud Storage emulator fixtures (gcs_emulator, gcs_bucket) for the gs:// tests.
pytest_plugins = ["tests.gcs_emulator"]

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One persistent XLA compilation cache for the whole session, shared by every process it starts
# (slice actors, `pagefleet run` subprocesses): the same step programs compile once, not once per process.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import tempfile

    _CACHE_DIR = tempfile.mkdtemp(prefix="pagefleet-xla-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE_DIR
# Caches a test run fills (a gs:// model's tokenizer files) stay out of the home directory.
import tempfile as _tempfile

_XDG_CACHE = _tempfile.mkdtemp(prefix="pagefleet-test-cache-")
os.environ["XDG_CACHE_HOME"] = _XDG_CACHE


def pytest_configure(config):
    # The pytest process itself compiles hundreds of programs for many models and engine settings; it keeps
    # them in JAX's in-memory caches and never writes the persistent cache. On jaxlib 0.10.2, serializing one
    # executable for that cache segfaulted this process after a few hundred tests (reproducibly in the full
    # run, never with a test file alone; the cause inside XLA is not found). The processes it starts (slices,
    # `pagefleet run` subprocesses) still share the cache above.
    import jax

    jax.config.update("jax_enable_compilation_cache", False)


def pytest_sessionfinish(session, exitstatus):
    import shutil

    shutil.rmtree(_XDG_CACHE, ignore_errors=True)
    if "_CACHE_DIR" in globals():
        shutil.rmtree(_CACHE_DIR, ignore_errors=True)
