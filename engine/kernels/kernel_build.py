"""Compiling the native CPU kernels (`cpu_kernel/*.cc`: ragged paged attention and RoPE, and the experts of a mixture
of experts' generated tokens) into one library, without importing JAX.

The build is a few seconds of `g++` once per machine. Kept apart from `cpu_attention.py` (which needs
JAX to load and call the kernel) so that a command can start it before its own imports: the compiler
then runs on one core while the process imports JAX, loads the tokenizer and reads the weights on the
other (`start()`), and the later `build()` waits for that build instead of running its own.

The library is kept next to the XLA compilation cache (`compile_cache.py`; `PAGEFLEET_COMPILE_CACHE=off`
builds it in a temporary directory for this process only). Its file name carries a hash of the source,
the flags, the compiler, the CPU and jaxlib, so a change to any of them builds a new one.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from concurrent.futures import Future
from pathlib import Path

import jaxlib

from engine.device import compile_cache
KERNEL_DIR = Path(__file__).with_name("cpu_kernel")
SOURCES = tuple(KERNEL_DIR / name for name in ("ragged_paged_attention.cc", "moe_experts.cc"))
HEADERS = (KERNEL_DIR / "work_items.h",)
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno", "-fopenmp-simd", "-ffp-contract=off")
TEMP_PREFIX = "pagefleet-kernel-"


class KernelUnavailable(RuntimeError):
    """The native kernel cannot be built or loaded here; the message says why."""


def include_dir() -> str:
    """jaxlib's bundled headers (`xla/ffi/api/ffi.h`): what `jax.ffi.include_dir()` returns."""
    return os.path.join(os.path.dirname(os.path.abspath(jaxlib.__file__)), "include")


def _cpu_signature() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
        return next((line for line in info.splitlines() if line.startswith("flags")), platform.processor())
    except OSError:
        return platform.processor()


_lock = threading.Lock()
_temp_dir: list[Path] = []  # with the cache off: one temporary directory for the life of the process
_builds: dict[Path, Future] = {}  # library path -> its build in this process (done or under way)


def _build_dir() -> Path:
    cache = compile_cache.directory()
    if cache is not None:
        return Path(cache) / "kernels"
    with _lock:
        if not _temp_dir:
            _temp_dir.append(Path(tempfile.mkdtemp(prefix=TEMP_PREFIX)))
        return _temp_dir[0]


def _plan() -> tuple[list[str], Path]:
    """(the command line less its output, the library's path); raises KernelUnavailable."""
    compiler = os.environ.get("CXX") or "g++"
    if shutil.which(compiler) is None:
        raise KernelUnavailable(f"no C++ compiler {compiler!r} on PATH (set CXX)")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    include = include_dir()
    texts = [path.read_text() for path in (*SOURCES, *HEADERS)]
    parts = [*texts, " ".join(FLAGS), version, _cpu_signature(), jaxlib.__version__, include]
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
    return [compiler, *FLAGS, "-isystem", include, *map(str, SOURCES)], _build_dir() / f"cpu_kernels-{key}.so"


def _compile(cmd: list[str], library: Path) -> Path:
    if library.exists():
        return library
    library.parent.mkdir(parents=True, exist_ok=True)
    tmp = library.parent / f".{library.name}.{os.getpid()}.{threading.get_ident()}.tmp"
    proc = subprocess.run([*cmd, "-o", str(tmp)], capture_output=True, text=True)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise KernelUnavailable(f"building the CPU kernels failed ({' '.join(cmd)}):\n{proc.stderr[-2000:]}")
    os.replace(tmp, library)  # atomic: a concurrent process sees the whole library or none
    return library


def _submit(cmd: list[str], library: Path, background: bool) -> Future:
    with _lock:
        future = _builds.get(library)
        if future is not None and not (future.done() and future.exception() is not None):
            return future  # built, or being built by another thread: wait for that one
        future = _builds[library] = Future()

    def work() -> None:
        try:
            future.set_result(_compile(cmd, library))
        except BaseException as err:  # noqa: BLE001 - handed to whoever waits on the build
            future.set_exception(err)

    if background:
        threading.Thread(target=work, name="pagefleet-kernel-build", daemon=True).start()
    else:
        work()
    return future


def build() -> Path:
    """Compile the kernel (or find it compiled, or wait for the build `start()` began); returns the shared
    library's path."""
    cmd, library = _plan()
    try:
        return _submit(cmd, library, background=False).result()
    except OSError as err:
        raise KernelUnavailable(f"building the CPU kernels failed: {err}") from err


def start() -> None:
    """Begin the build on a thread if the library is not there yet; never raises (a problem is reported by
    the `build()` that needs the kernel)."""
    try:
        cmd, library = _plan()
        if not library.exists():
            _submit(cmd, library, background=True)
    except (KernelUnavailable, OSError, subprocess.SubprocessError):
        pass


def backend_is_cpu_only() -> bool:
    """Whether JAX will run on the CPU in this process, judged without importing JAX: `JAX_PLATFORMS`
    names cpu first, or no accelerator plugin is installed. Only a hint for starting the build early."""
    import importlib.metadata
    import importlib.util

    platforms = os.environ.get("JAX_PLATFORMS", "").strip()
    if platforms:
        return platforms.split(",")[0].strip() == "cpu"
    if any(importlib.util.find_spec(name) is not None for name in ("libtpu", "jax_plugins")):
        return False
    return not any(True for _ in importlib.metadata.entry_points(group="jax_plugins"))


def main() -> int:
    """`python -m engine.kernels.kernel_build`: build the kernel now (the README's set-up does), so that the first
    job on the machine does not wait for the compiler. Never fails the set-up: without a compiler the
    engine uses the JAX reference attention, and this says so."""
    import sys
    import time

    if not backend_is_cpu_only():
        print("pagefleet: JAX has an accelerator here; the CPU kernels are not needed", file=sys.stderr)
        return 0
    t = time.perf_counter()
    try:
        library = build()
    except KernelUnavailable as err:
        print(f"pagefleet: the CPU kernels cannot be built ({err}); the engine will use the slower "
              "JAX reference attention and XLA's matmuls for the experts", file=sys.stderr)
        return 0
    print(f"pagefleet: CPU kernels ready in {time.perf_counter() - t:.1f} s: {library}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
