"""Ragged paged attention on the CPU as a native kernel (`cpu_kernel/ragged_paged_attention.cc`).

The kernel is an XLA FFI custom call compiled on first use with the machine's C++ compiler (`CXX`,
else `g++`) for this CPU (`-march=native`) and kept next to the XLA compilation cache (see
`compile_cache.py`; `PAGEFLEET_COMPILE_CACHE=off` builds it in a temporary directory for this process
only). The file name carries a hash of the source, the flags, the compiler, the CPU and jaxlib, so a
change to any of them builds a new one. Building takes a few seconds, once per machine.

It takes float32 queries and a float32 pool; the engine falls back to the plain-JAX reference for
other dtypes, or when no compiler is found (logged once, with the reason).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import jax
import jaxlib
import jax.numpy as jnp
import numpy as np

from engine import compile_cache

SOURCE = Path(__file__).with_name("cpu_kernel") / "ragged_paged_attention.cc"
TARGET = "pagefleet_ragged_paged_attention_f32"
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno", "-fopenmp-simd", "-ffp-contract=off")


class KernelUnavailable(RuntimeError):
    """The native kernel cannot be built or loaded here; the message says why."""


def _cpu_signature() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
        return next((line for line in info.splitlines() if line.startswith("flags")), platform.processor())
    except OSError:
        return platform.processor()


_TEMP_PREFIX = "pagefleet-kernel-"


def _build_dir() -> Path:
    cache = compile_cache.directory()
    if cache is None:
        return Path(tempfile.mkdtemp(prefix=_TEMP_PREFIX))
    return Path(cache) / "kernels"


def build() -> Path:
    """Compile the kernel (or find it already compiled); returns the shared library's path."""
    compiler = os.environ.get("CXX") or "g++"
    if shutil.which(compiler) is None:
        raise KernelUnavailable(f"no C++ compiler {compiler!r} on PATH (set CXX)")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    include = jax.ffi.include_dir()
    parts = [SOURCE.read_text(), " ".join(FLAGS), version, _cpu_signature(), jaxlib.__version__, include]
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
    out_dir = _build_dir()
    library = out_dir / f"ragged_paged_attention-{key}.so"
    if library.exists():
        return library
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / f".{library.name}.{os.getpid()}.tmp"
    cmd = [compiler, *FLAGS, "-isystem", include, str(SOURCE), "-o", str(tmp)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise KernelUnavailable(f"building {SOURCE.name} failed ({' '.join(cmd)}):\n{proc.stderr[-2000:]}")
    os.replace(tmp, library)  # atomic: a concurrent process sees the whole library or none
    return library


_load_lock = threading.Lock()
_outcome: list[str | None] = []  # once decided: [None] (ready) or [why not], for the life of the process


def unavailable_reason() -> str | None:
    """None when the kernel is built, loaded and registered with XLA in this process (done on the first
    call), else why it is not. A build started by prepare_in_background() is waited for, not repeated."""
    with _load_lock:
        if not _outcome:
            try:
                library = build()
                _load(library)
                _outcome.append(None)
                if library.parent.name.startswith(_TEMP_PREFIX):  # no cache: the loaded library needs no file
                    shutil.rmtree(library.parent, ignore_errors=True)
            except (KernelUnavailable, OSError, subprocess.SubprocessError) as err:
                _outcome.append(str(err))
        return _outcome[0]


def load() -> None:
    """Make the kernel ready (see unavailable_reason); raises KernelUnavailable with the reason."""
    reason = unavailable_reason()
    if reason is not None:
        raise KernelUnavailable(reason)


def _load(library: Path) -> None:
    try:
        handler = ctypes.cdll.LoadLibrary(str(library)).PagefleetRaggedPagedAttentionF32
    except (OSError, AttributeError) as err:
        raise KernelUnavailable(f"loading {library} failed: {err}") from err
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(handler), platform="cpu")


def prepare_in_background() -> None:
    """Start building and loading the kernel on a thread, so that the compiler runs while the caller does
    other start-up work (reading weights, importing the tokenizer); later calls find it ready or wait."""
    threading.Thread(target=unavailable_reason, name="pagefleet-kernel-build", daemon=True).start()


def supports(q_dtype, kv_dtype) -> bool:
    return jnp.dtype(q_dtype) == jnp.float32 and jnp.dtype(kv_dtype) == jnp.float32


def ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale: float,
                           sliding_window: int | None) -> jax.Array:
    """Same contract as `attention.reference_ragged_paged_attention` (float32 only); `load()` first."""
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, q.dtype))
    return call(q, kv_pages, kv_lens.astype(jnp.int32), page_indices.astype(jnp.int32), cu_q_lens.astype(jnp.int32),
                num_seqs.astype(jnp.int32), sm_scale=np.float32(sm_scale), sliding_window=np.int32(sliding_window or 0))
