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
