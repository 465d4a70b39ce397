"""The persistent XLA compilation cache, on by default: a step program compiled once is loaded, not
compiled again, by every later process on the machine (the next `pagefleet generate`, a resumed run,
a replaced slice).

Where it lives, first match wins:
1. `JAX_COMPILATION_CACHE_DIR` (JAX's own setting, also honoured by any JAX program);
2. `PAGEFLEET_COMPILE_CACHE`: a directory, or `off` to compile from scratch in every process;
3. `$XDG_CACHE_HOME/pagefleet/xla`, else `~/.cache/pagefleet/xla`.

JAX only caches programs that took at least a second to compile; the engine's step programs on a CPU
take about that long each, and the small ones (the KV pool, page copies) add up, so every program is
cached here. The directory is trusted code: do not point it at a place others may write to.
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

ENV = "PAGEFLEET_COMPILE_CACHE"


def default_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "pagefleet" / "xla"


def directory() -> str | None:
    """The cache directory this process uses (or would use once enabled); None when it is off. Does not
    import JAX (the CPU kernel's build asks before JAX is imported): until it is, only the environment can
    have set JAX's own setting."""
    jax = sys.modules.get("jax")
    configured = (jax.config.jax_compilation_cache_dir if jax is not None and hasattr(jax, "config")
                  else os.environ.get("JAX_COMPILATION_CACHE_DIR"))
    if configured:
        return configured
    choice = os.environ.get(ENV, "").strip()
    if choice.lower() == "off":
        return None
    return choice or str(default_dir())


def enable() -> str | None:
    """Turn the persistent cache on for this process (before the first compile); returns its directory,
    or None when it is off."""
    import jax

    directory = jax.config.jax_compilation_cache_dir
    if not directory:
        choice = os.environ.get(ENV, "").strip()
        if choice.lower() == "off":
            return None
        directory = choice or str(default_dir())
        jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return directory


PROGRAM_FIGURES = ("programs_compiled", "compile_s", "programs_loaded", "program_load_s", "trace_lower_s")
"""`programs`' figures under the names every report uses (generate's summary and --stats_output, timeline.jsonl, the
run's summary and W&B, `pagefleet status`): sums over calls, buckets and slices."""
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # a program's compile, or its load from the cache
LOAD_EVENT = "/jax/compilation_cache/cache_retrieval_time_sec"  # a program loaded from the cache (one per load)
TRACE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration")
_totals = {"programs": 0, "programs_loaded": 0, "seconds": 0.0, "load_s": 0.0, "trace_lower_s": 0.0}
_counting = []
_lock = threading.Lock()  # a slice compiles on its engine thread while others may (a page copy, a test's engines)


def _on_duration(event: str, seconds: float, **_) -> None:
    with _lock:
        if event == COMPILE_EVENT:
            _totals["programs"] += 1
            _totals["seconds"] += seconds
        elif event == LOAD_EVENT:
            _totals["programs_loaded"] += 1
            _totals["load_s"] += seconds
        elif event in TRACE_EVENTS:
            _totals["trace_lower_s"] += seconds


def count_programs() -> None:
    """Count, from now on in this process, the XLA programs compiled and those loaded from the cache (`programs`).
    Idempotent."""
    if not _counting:
        from jax import monitoring

        monitoring.register_event_duration_secs_listener(_on_duration)
        _counting.append(True)


def programs() -> dict[str, float]:
    """This process's XLA programs since `count_programs`: `programs_compiled` and `compile_s` (XLA's compile),
    `programs_loaded` and `program_load_s` (from the persistent cache: a load is no compile), `trace_lower_s`
    (JAX's tracing and lowering to XLA, which every process does for each program it uses, cache or not)."""
    with _lock:
        t = dict(_totals)
    return dict(zip(PROGRAM_FIGURES, (t["programs"] - t["programs_loaded"], t["seconds"] - t["load_s"],
                                      t["programs_loaded"], t["load_s"], t["trace_lower_s"])))


def programs_since(before: dict[str, float]) -> dict[str, float]:
    """`programs` since an earlier reading of it."""
    now = programs()
    return {k: now[k] - before[k] for k in PROGRAM_FIGURES}
