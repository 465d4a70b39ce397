"""Where the run executes: the Ray cluster and the slices in it."""

from __future__ import annotations

import logging
import os
import signal
import socket
import stat
import tempfile
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ClusterConfig:
    num_slices: int = 1
    """Accelerator slices (one actor, or one gang of host actors, each)."""
    hosts_per_slice: int = 1
    """Host processes per slice; more than one makes a multi-host slice."""
    devices_per_host: int | None = None
    """On CPU: how many XLA host devices each host process exposes; None keeps the default."""
    mesh: dict[str, int] = field(default_factory=lambda: {"model": 1})
    """Named mesh axes inside a slice: `model` is each engine's tensor-parallel width T (a divisor of the model's KV
    heads, or a multiple of them that divides its attention heads: each KV head is then replicated T / kv_heads
    times; T also divides the MLP width and, for a mixture of experts, the number of experts, spread whole over
    the T devices); `data` is D, the slice's independent engines, each on T devices of one host with its own scheduler,
    KV pool and copy of the weights (D x T must equal the slice's devices; on a multi-host slice every host runs
    D / hosts_per_slice of them, with no collective across hosts). Checked at the head against the devices and
    the model's config.json before any slice starts."""
    resources_per_host: dict[str, float] = field(default_factory=lambda: {"CPU": 1})
    """Ray resources each host actor of a slice requests, e.g. {"TPU": 4} for one v5p host's chips;
    a slice's host 0 also requests the slice's head resource when `slice_head_resource` is set."""
    slice_head_resource: str | None = None
    """Ray's per-slice head resource on TPU (e.g. "TPU-v5p-16-head"): makes each slice land on its own pod slice.
    On a multi-host slice, host 0 takes it and the other hosts go to nodes with the same `ray.io/tpu-slice-name`
    label as host 0's node (Ray labels TPU hosts so), never to another pod slice's hosts."""
    samples_in_flight_per_slice: int | None = None
    """Unfinished samples a slice holds at once (running plus queued in its engines, counted sample by sample as
    they finish); defaults to 2 * engine.max_seqs per engine (times cluster.mesh.data), so the next batches are
    already queued when slots free up and every engine stays full across batches."""
    max_slice_restarts: int = 3
    """Times a slice that died (or failed to start) is replaced before the run gives up on it."""
    placement_strategy: str = "SPREAD"
    """Ray placement-group strategy for a multi-host slice's host actors: STRICT_SPREAD puts each on its own
    node (TPU hosts); PACK or SPREAD also allow one machine (CPU tests)."""
    host_timeout_s: float = 900.0
    """A slice that holds batches but completes no engine step for this long (a host that hangs or died
    inside a collective), or that takes this long to start, is torn down and its batches retried."""
    local_num_cpus: int | None = None
    """CPUs of the local Ray started in-process when there is no cluster (RAY_ADDRESS unset); None = all."""

    def __post_init__(self) -> None:
        if self.placement_strategy not in ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"):
            raise ValueError(f"cluster.placement_strategy must be PACK, SPREAD, STRICT_PACK or STRICT_SPREAD, "
                             f"got {self.placement_strategy!r}")
        if self.host_timeout_s <= 0:
            raise ValueError(f"cluster.host_timeout_s must be positive, got {self.host_timeout_s}")
        for name in ("num_slices", "hosts_per_slice"):
            if getattr(self, name) < 1:
                raise ValueError(f"cluster.{name} must be at least 1, got {getattr(self, name)}")
        if self.samples_in_flight_per_slice is not None and self.samples_in_flight_per_slice < 1:
            raise ValueError(f"cluster.samples_in_flight_per_slice must be at least 1, got {self.samples_in_flight_per_slice}")
        if any(width < 1 for width in self.mesh.values()):
            raise ValueError(f"cluster.mesh widths must be at least 1, got {self.mesh}")


def engines_per_slice(mesh: dict[str, int], num_hosts: int) -> int:
    """Data-parallel engines a slice runs: `cluster.mesh.data` (each on `model` devices of one host, with its own
    scheduler, KV pool and weights); 1 when it is not given (one engine, an SPMD program over a multi-host slice)."""
    return mesh.get("data", 1)


def host_level(mesh: dict[str, int], num_hosts: int) -> bool:
    """A multi-host slice of data-parallel engines: every host runs its own engines on its own devices, as
    independent JAX processes (no jax.distributed, no collective across hosts)."""
    return num_hosts > 1 and mesh.get("data", 1) > 1


def spmd(mesh: dict[str, int], num_hosts: int) -> bool:
    """Several hosts running one engine as one SPMD program (jax.distributed); not so for host-level data
    parallelism, where every host is an independent JAX process with engines of its own."""
    return num_hosts > 1 and not host_level(mesh, num_hosts)


def engines_per_host(mesh: dict[str, int], num_hosts: int) -> int:
    """Engines in one host process of the slice."""
    engines = engines_per_slice(mesh, num_hosts)
    return engines // num_hosts if host_level(mesh, num_hosts) else engines


class ClusterGone(RuntimeError):
    """The cluster pagefleet would join does not answer; the message says where its address came from and the fix."""


class RayDidNotStart(ClusterGone):
    """ray.init failed (a start-up timeout, a raylet that died, a cluster that refused us): what Ray said, in one line,
    and the fix."""


ANSWER_TIMEOUT_S = 5.0
"""How long the cluster's GCS port has to accept a connection before the cluster is reported gone."""


def existing_cluster() -> str | None:
    """The address of the cluster `ray.init()` would join: RAY_ADDRESS, else the one a `ray start` on this
    machine recorded (RAY_TMPDIR/ray/ray_current_cluster, default /tmp/ray); None when there is none, or when
    RAY_ADDRESS=local (a local Ray started in-process, whatever `ray start` recorded)."""
    if os.environ.get("RAY_ADDRESS"):
        return None if os.environ["RAY_ADDRESS"] == "local" else os.environ["RAY_ADDRESS"]
    from ray._private.services import find_bootstrap_address  # how ray.init() itself finds a `ray start` cluster

    return find_bootstrap_address(None)


def check_answers(address: str, timeout_s: float = ANSWER_TIMEOUT_S) -> None:
    """Raise ClusterGone when a GCS address (`host:port`) accepts no connection within `timeout_s`: ray.init
    would retry it for minutes. Other address forms (ray://, http://, auto) are left to Ray."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or "/" in address or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
        return
    except OSError as e:
        why = "no answer" if isinstance(e, TimeoutError) else (e.strerror or type(e).__name__).lower()
    if os.environ.get("RAY_ADDRESS"):
        raise ClusterGone(f"the Ray cluster in RAY_ADDRESS ({address}) does not answer ({why} within {timeout_s:g} s); "
                          "start it, set RAY_ADDRESS to a live cluster, or unset it (RAY_ADDRESS=local starts a "
                          "local Ray in this process)")
    from ray._common.utils import get_ray_address_file

    raise ClusterGone(f"the Ray cluster recorded by a `ray start` on this machine ({address}, in "
                      f"{get_ray_address_file(None)}) does not answer ({why} within {timeout_s:g} s): it is gone; "
                      f"remove that file (or run `ray stop`) to start a local Ray, or set RAY_ADDRESS to a live "
                      "cluster (RAY_ADDRESS=local starts a local Ray whatever the file says)")


def ensure_ray(cluster: ClusterConfig) -> None:
    """Connect to an existing cluster (RAY_ADDRESS, or a `ray start` on this machine), or start a local Ray in
    this process with `cluster.local_num_cpus` CPUs, its session files under `local_ray_temp_dir()`. An existing
    cluster has its own CPUs: the key is ignored there, with a note in the log, rather than refused as ray.init
    refuses it."""
    import ray

    if ray.is_initialized():
        return
    address = existing_cluster()
    if address:
        check_answers(address)
    with _python_sigterm_kept(), warnings.catch_warnings():
        # Ray starts its processes with subprocess (fork, then exec at once): JAX's warning that a fork of its
        # threads may deadlock does not apply, and with JAX loaded (pagefleet.generate first) it printed twice.
        warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called", category=RuntimeWarning)
        if address and cluster.local_num_cpus is not None:
            log.warning("connecting to the existing Ray cluster at %s: cluster.local_num_cpus=%d is ignored (it "
                        "sizes only a Ray started in-process)", address, cluster.local_num_cpus)
        temp_dir = None if address else local_ray_temp_dir()
        try:
            if address:
                ray.init(address=address, log_to_driver=False)
            else:
                ray.init(num_cpus=cluster.local_num_cpus, include_dashboard=False, log_to_driver=False,
                         _temp_dir=temp_dir)
        except Exception as e:  # noqa: BLE001 - whatever kept Ray from starting, as one line with the fix
            said = (str(e).strip().splitlines() or [type(e).__name__])[0]
            if address:
                raise RayDidNotStart(f"could not join the Ray cluster at {address} ({type(e).__name__}: {said}); "
                                     "check that it is up (`ray status` there), or unset RAY_ADDRESS to start a local "
                                     "Ray") from None
            raise RayDidNotStart(f"a local Ray did not start ({type(e).__name__}: {said}); this machine may be short "
                                 f"of memory, CPU or disk (Ray's session files are under {temp_dir or 'RAY_TMPDIR'}): "
                                 "free some and rerun, or set RAY_ADDRESS to a running cluster") from None


@contextmanager
def _python_sigterm_kept() -> Iterator[None]:
    """ray.init replaces this process's SIGTERM handler with its own (a C-level stack dump, then exit 15); a Python
    handler set before it (the head's clean stop, orchestrator/run/driver.py) is put back."""
    main = threading.current_thread() is threading.main_thread()
    before = signal.getsignal(signal.SIGTERM) if main else None
    yield
    if callable(before):
        signal.signal(signal.SIGTERM, before)


_MAX_TEMP_BASE = 16  # Ray's longest unix socket lies ~90 characters below this base; a socket path holds 107


def local_ray_temp_dir() -> str | None:
    """Where a local Ray keeps its session (logs, sockets, spilled objects): `pagefleet-ray-UID/ray` in the user's
    temp directory (TMPDIR; /tmp when that is unset or too long for Ray's socket paths), instead of Ray's default
    /tmp/ray, which every user on the machine shares. Ray makes its own directory world-writable, so it goes one
    level down, inside `pagefleet-ray-UID`, made 0700 and checked to be the user's own. None when RAY_TMPDIR is set:
    Ray then uses what the user chose."""
    if os.environ.get("RAY_TMPDIR"):
        return None
    base = tempfile.gettempdir()
    if len(base) > _MAX_TEMP_BASE:
        base = "/tmp"
    own = os.path.join(base, f"pagefleet-ray-{os.getuid()}")
    os.makedirs(own, mode=0o700, exist_ok=True)
    info = os.lstat(own)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise PermissionError(f"{own} is not a directory of this user's; remove it, or set RAY_TMPDIR to a directory "
                              "of your own for Ray's session files")
    if info.st_mode & 0o077:
        os.chmod(own, 0o700)
    return os.path.join(own, "ray")
