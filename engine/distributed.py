"""Multi-host slices: several JAX processes run one Engine as a single SPMD program.

Every host process of a slice calls `initialize`, builds the same `slice_mesh`, constructs the same
Engine on it and feeds it the same requests in the same order; each then makes the same compiled
calls in the same order and reads the same (replicated) results. `agree` is the check, before any
engine step, that the hosts really hold the same inputs: a host that drifted would otherwise hang
a collective or silently compute on different data.

What needs no special handling (checked by tests/engine/test_multihost.py):
* step inputs are host numpy arrays; `jit` treats a host value passed for a replicated input as the
  global value, which is correct because every host builds the same value;
* sampled tokens and logprobs come out replicated over the mesh (the runner constrains them), so
  each host reads them from its own devices, with no cross-host fetch and no leader.
"""

from __future__ import annotations

import hashlib
import os

import jax
import numpy as np
from jax.sharding import Mesh


def initialize(coordinator_address: str, num_processes: int, process_id: int,
               local_device_count: int | None = None) -> None:
    """Join the slice's JAX process group (call before anything else touches JAX devices).

    `coordinator_address` is host 0's "ip:port"; `local_device_count` forces that many CPU devices
    in this process (tests and CPU slices; it must be set before JAX creates its CPU backend).
    Cross-process collectives on CPU use gloo.
    """
    if local_device_count is not None:
        flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
                 if not f.startswith("--xla_force_host_platform_device_count")]
        os.environ["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={local_device_count}"])
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                               process_id=process_id)


def slice_mesh(model: int) -> Mesh:
    """A ("data", "model") mesh over every device of every process: shape (num_devices // model, model).

    Devices are taken in `jax.devices()` order (process by process), so a `model` axis no larger
    than one host's device count stays inside a host and only the `data` axis crosses hosts.
    """
    devices = jax.devices()
    if model < 1 or len(devices) % model:
        raise ValueError(f"cluster.mesh.model={model} must divide the slice's {len(devices)} devices "
                         f"({jax.process_count()} processes x {jax.local_device_count()} devices)")
    return Mesh(np.array(devices).reshape(len(devices) // model, model), ("data", "model"))


class HostsDisagree(RuntimeError):
    """Hosts of one slice hold different inputs; raised on every host, before any engine step."""


def digest(value: str) -> np.ndarray:
    """u32[2]: a stable hash of `value` (blake2b, not Python's salted `hash()`)."""
    return np.frombuffer(hashlib.blake2b(value.encode("utf-8"), digest_size=8).digest(), "<u4").astype(np.uint32)


def agree(values: dict[str, str]) -> None:
    """Raise `HostsDisagree` on every host unless every host passed the same `values`.

    Each host hashes what it holds (e.g. {"engine_config": repr(config), "batch": ...}); the hashes
    are gathered from all processes (a fixed, trivial compiled program, the same on every host) and
    compared. The error names the keys that differ and which processes hold which version. Every
    process of the JAX process group must call it (the Engine does when its mesh spans processes).
    A no-op in a single process. Two rounds, both of fixed shape, so hosts that disagree on the set of keys
    still make the same calls and all raise instead of hanging.
    """
    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils

    names = sorted(values)
    keys = digest("\0".join(names))
    header = np.concatenate([np.array([len(names)], np.uint32), keys])  # u32[3]
    headers = np.asarray(multihost_utils.process_allgather(header))  # u32[processes, 3]
    if not (headers == headers[0]).all():
        counts = ", ".join(f"process {p}: {int(h[0])} keys" for p, h in enumerate(headers))
        raise HostsDisagree(f"hosts of this slice hold different sets of keys ({counts}); this host "
                            f"(process {jax.process_index()}) holds {names}; every host must be given the same "
                            f"config and batch")
    if not names:
        return
    local = np.stack([digest(values[n]) for n in names])  # u32[keys, 2]
    hashes = np.asarray(multihost_utils.process_allgather(local))  # u32[processes, keys, 2]
    differing = []
    for k, name in enumerate(names):
        groups: dict[str, list[int]] = {}
        for p in range(hashes.shape[0]):
            groups.setdefault(hashes[p, k].tobytes().hex(), []).append(p)
        if len(groups) > 1:
            held = "; ".join(f"processes {ps} hold hash {h}" for h, ps in groups.items())
            differing.append(f"{name!r} ({held})")
    if differing:
        raise HostsDisagree(f"hosts of this slice disagree on {', '.join(differing)}; this host is process "
                            f"{jax.process_index()}; every host must be given the same config and batch, in the same "
                            f"order, before any engine step")
