"""Ragged paged attention on the CPU as a native kernel (`cpu_kernel/ragged_paged_attention.cc`), with RoPE and, in
the same library, a mixture of experts' MLPs for generated tokens (`cpu_kernel/moe_experts.cc`).

The kernel is an XLA FFI custom call compiled on first use with the machine's C++ compiler (`CXX`,
else `g++`) for this CPU (`-march=native`); `kernel_build.py` builds it (a few seconds, once per
machine) and says where it is kept.

It takes float32 queries and a float32 pool; the engine falls back to the plain-JAX reference for
other dtypes, or when no compiler is found (logged once, with the reason).
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from engine.kernels.kernel_build import TEMP_PREFIX, KernelUnavailable, build

__all__ = ["KernelUnavailable", "build", "load", "moe_experts", "prepare_in_background", "ragged_paged_attention",
           "supports", "unavailable_reason"]

TARGET = "pagefleet_ragged_paged_attention_f32"


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
                if library.parent.name.startswith(TEMP_PREFIX):  # no cache: the loaded library needs no file
                    shutil.rmtree(library.parent, ignore_errors=True)
            except (KernelUnavailable, OSError, subprocess.SubprocessError) as err:
                _outcome.append(str(err))
        return _outcome[0]


def load() -> None:
    """Make the kernel ready (see unavailable_reason); raises KernelUnavailable with the reason."""
    reason = unavailable_reason()
    if reason is not None:
        raise KernelUnavailable(reason)


ROPE_TARGET = "pagefleet_rope_f32"
MOE_TARGET = "pagefleet_moe_experts_f32"


def _load(library: Path) -> None:
    try:
        lib = ctypes.cdll.LoadLibrary(str(library))
        handler, rope, moe = lib.PagefleetRaggedPagedAttentionF32, lib.PagefleetRopeF32, lib.PagefleetMoeExpertsF32
    except (OSError, AttributeError) as err:
        raise KernelUnavailable(f"loading {library} failed: {err}") from err
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(handler), platform="cpu")
    jax.ffi.register_ffi_target(ROPE_TARGET, jax.ffi.pycapsule(rope), platform="cpu")
    jax.ffi.register_ffi_target(MOE_TARGET, jax.ffi.pycapsule(moe), platform="cpu")


def rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [T, heads, D] rotated by RoPE (cos, sin: f32[T, D], rotate-half layout), float32, in native code: each
    product rounded before the sum, wherever the step's program puts it (XLA would contract one product into an FMA
    in some fusions and not in others); `load()` first."""
    return jax.ffi.ffi_call(ROPE_TARGET, jax.ShapeDtypeStruct(x.shape, jnp.float32))(
        x.astype(jnp.float32), cos.astype(jnp.float32), sin.astype(jnp.float32))


def moe_experts(x: jax.Array, pair_expert: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array
                ) -> jax.Array:
    """Each pair's expert MLP f32[P, H], down(silu(x w_gate) * (x w_up)), for pair p: row p // (P / R) of x f32[R, H]
    with expert pair_expert[p] of w_gate, w_up f32[E, H, I], w_down f32[E, I, H] (outside [0, E): none, zeros). Each
    output element is one chain of multiply-adds in order, so a pair's bits depend on its row and its expert only;
    float32, `load()` first."""
    call = jax.ffi.ffi_call(MOE_TARGET, jax.ShapeDtypeStruct((pair_expert.shape[0], x.shape[1]), jnp.float32))
    return call(x.astype(jnp.float32), pair_expert.astype(jnp.int32), w_gate.astype(jnp.float32),
                w_up.astype(jnp.float32), w_down.astype(jnp.float32))


def prepare_in_background() -> None:
    """Start building and loading the kernel on a thread, so that the compiler runs while the caller does
    other start-up work (reading weights, importing the tokenizer); later calls find it ready or wait."""
    threading.Thread(target=unavailable_reason, name="pagefleet-kernel-build", daemon=True).start()


def supports(q_dtype, kv_dtype) -> bool:
    return jnp.dtype(q_dtype) == jnp.float32 and jnp.dtype(kv_dtype) == jnp.float32


def ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale: float,
                           sliding_window: int | None, soft_cap: float | None = None, share_pages: bool = True
                           ) -> jax.Array:
    """Same contract as `attention.reference_ragged_paged_attention` (float32 only); `load()` first.

    share_pages: decoding sequences whose first pages are the same physical pages (a prefix cache hit) walk those
    pages together, their rows in vector lanes, each page read once for all of them; the bits are the same either
    way (False: each sequence alone, for comparison)."""
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, q.dtype))
    return call(q, kv_pages, kv_lens.astype(jnp.int32), page_indices.astype(jnp.int32), cu_q_lens.astype(jnp.int32),
                num_seqs.astype(jnp.int32), sm_scale=np.float32(sm_scale), sliding_window=np.int32(sliding_window or 0),
                soft_cap=np.float32(soft_cap or 0.0), share_pages=bool(share_pages))
