"""One slice as the head sees it: a gang of host actors (one per host) started and torn down together.

A single-host slice is a gang of one. On a multi-host slice the host actors are placed together (a
Ray placement group), host 0 names the jax.distributed coordinator, every host gets every batch, and
host 0 alone returns results; the others' polls are heartbeats. The gang keeps the head's flow control: it
counts the samples sent to each host and, with each batch, tells the host at how many finished samples the head
wants its poll back (the slice's budget, `cluster.samples_in_flight_per_slice`, split evenly over independent
hosts). A multi-host slice of data-parallel engines
(`cluster.mesh.data` > 1, host-level) has no coordinator: every host is an independent JAX process running
data / hosts engines on its own devices, each batch goes to the one host holding the fewest unfinished
samples, and every host returns its own results. Liveness: a host actor that dies
fails the slice at once; a slice that holds batches but takes no engine step for
`cluster.host_timeout_s` (a hung host blocks the others inside a collective), or that does not
start within it, is reported as failed too.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from engine import CheckpointError, MeshError, PoolTooLarge, UnsupportedModelError
from orchestrator.config import RunConfig
from orchestrator.plan.weights_identity import WeightsChanged
from orchestrator.slices.cluster import host_level
from orchestrator.slices.slice import SliceSpec, SliceWorker
from orchestrator.slices.tpu_placement import SLICE_NAME_LABEL, single_host_tpu_env, slice_name
from orchestrator.state.batch_files import RunDirUnreachable
from orchestrator.state.faults import slice_environment
from orchestrator.state.results import BatchWork, Result
from orchestrator.state.rundir import RunDir
from orchestrator.storage import location

POLL_S = 1.0


@dataclass(frozen=True)
class GangEvent:
    kind: str  # "waiting" | "started" | "results" | "failed"
    results: list[Result] | None = None
    info: dict | None = None
    reason: str | None = None
    fatal: bool = False
    """With "failed": the slice failed on a deterministic fault (a checkpoint it cannot load, a mesh the model cannot
    be sharded over): every slice would, so restarting cannot help."""


class SliceGang:
    def __init__(self, index: int, cfg: RunConfig) -> None:
        self.index = index
        self.cfg = cfg
        self.actors: list[Any] = []
        self.placement_group = None  # every host's bundle; on a TPU pod slice, hosts 1.. only
        self._head_group = None  # on a TPU pod slice: host 0's bundle, with the slice head resource
        self._locating = None  # on a TPU pod slice: the ref of the pod slice name of host 0's node
        self._slice_name: str | None = None
        self._starting: dict[Any, int] = {}  # start ref -> host
        self._polls: dict[Any, int] = {}  # poll ref -> host
        self._infos: dict[int, dict] = {}  # host -> what its start returned
        self._since = time.monotonic()  # spawn, or host 0's last engine step
        self._steps = -1

    @property
    def name(self) -> str:
        return f"slice-{self.index}"

    @property
    def num_hosts(self) -> int:
        return self.cfg.cluster.hosts_per_slice

    @property
    def ready(self) -> bool:
        return bool(self.actors) and not self._starting and len(self._polls) == len(self.actors)

    def spawn(self) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        cfg = self.cfg
        resources = dict(cfg.cluster.resources_per_host)
        num_cpus, num_gpus = resources.pop("CPU", 0), resources.pop("GPU", 0)
        env = slice_environment()  # a test's crash point in the slice's process, if any (faults.py)
        if cfg.cluster.devices_per_host:
            env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={cfg.cluster.devices_per_host}"
        self._host_level = host_level(cfg.cluster.mesh, self.num_hosts)
        if self._host_level and num_gpus == 0 and resources.get("TPU"):
            env.update(single_host_tpu_env(int(resources["TPU"])))
        head = {cfg.cluster.slice_head_resource: 1} if cfg.cluster.slice_head_resource else {}
        self._host_options = [
            dict(num_cpus=num_cpus, num_gpus=num_gpus, resources={**resources, **(head if host == 0 else {})} or None,
                 max_concurrency=4, max_restarts=0, runtime_env={"env_vars": env} if env else None)
            for host in range(self.num_hosts)]
        self.actors, self._starting, self._polls, self._infos = [], {}, {}, {}
        self._since = time.monotonic()
        self._host_batches = [0] * self.num_hosts  # batches submitted to each host (BatchWork.seq; host 0 alone
        # when the hosts run one SPMD program)
        self._host_sent = [0] * self.num_hosts  # samples sent to each host, and finished there (host 0 alone when
        self._host_finished = [0] * self.num_hosts  # the hosts run one SPMD program: every host gets every batch)
        self._host_steps = [0] * self.num_hosts
        self._slice_name = None
        if self.num_hosts > 1:
            # An actor in a placement group draws only on its bundle: host 0's bundle carries the head resource.
            bundles = [{k: v for k, v in {"CPU": num_cpus, "GPU": num_gpus, **(o["resources"] or {})}.items() if v}
                       for o in self._host_options]
            if head:
                # A TPU pod slice: the head resource picks a slice (host 0 lands on its worker 0); which slice that
                # is comes from the node's label, and the other hosts are then placed on the same slice (handle()).
                self._head_group = ray.util.placement_group(bundles[:1])
                self._other_bundles = bundles[1:]
                self._locating = ray.remote(slice_name).options(
                    num_cpus=0, scheduling_strategy=PlacementGroupSchedulingStrategy(self._head_group, 0)).remote()
                return
            self.placement_group = ray.util.placement_group(bundles, strategy=cfg.cluster.placement_strategy)
        self._start_hosts()

    def _start_hosts(self) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        cfg = self.cfg
        for host, options in enumerate(self._host_options):
            spec = SliceSpec(self.name, cfg.model.require_path(), cfg.model.tokenizer_path, cfg.model.dtype,
                             cfg.engine, cfg.sampling, dict(cfg.cluster.mesh), num_hosts=self.num_hosts,
                             host_index=host, devices_per_host=cfg.cluster.devices_per_host,
                             model_cache_dir=cfg.model.cache_dir, batches_dir=str(self.run_dir.batches),
                             weights=self._weights)
            if self._head_group is not None:  # host 0 in the head's group, the others in the slice's
                group, index = (self._head_group, 0) if host == 0 else (self.placement_group, host - 1)
            else:
                group, index = self.placement_group, host
            if group is not None:
                options = {**options, "scheduling_strategy": PlacementGroupSchedulingStrategy(group, index)}
            self.actors.append(ray.remote(SliceWorker).options(**options).remote(spec))
        # Host 0's coordinator address goes to every host as an ObjectRef: no blocking call in the head.
        spmd = self.num_hosts > 1 and not self._host_level
        coordinator = self.actors[0].coordinator_address.remote() if spmd else None
        self._starting = {a.start.remote(coordinator): host for host, a in enumerate(self.actors)}
        self._since = time.monotonic()
        self._steps = -1

    def refs(self) -> list:
        return [*([self._locating] if self._locating is not None else []), *self._starting, *self._polls]

    def handle(self, ref) -> GangEvent:
        """Take a finished locate, start or poll call; returns what it means for the slice."""
        import ray

        if self._locating is not None and ref == self._locating:
            self._locating = None
            try:
                name = ray.get(ref)
            except ray.exceptions.RayError as e:
                return GangEvent("failed", reason=f"could not start: {_error_text(e)}")
            if not name:
                return GangEvent("failed", reason=(
                    f"could not start: host 0 holds {self.cfg.cluster.slice_head_resource} but its node has no "
                    f"{SLICE_NAME_LABEL} label, so the other hosts cannot be placed on its pod slice; run on TPU "
                    "nodes (Ray labels them), or unset cluster.slice_head_resource"))
            self.placement_group = ray.util.placement_group(
                self._other_bundles, strategy=self.cfg.cluster.placement_strategy,
                bundle_label_selector=[{SLICE_NAME_LABEL: name}] * (self.num_hosts - 1))
            self._slice_name = name
            self._start_hosts()
            return GangEvent("waiting")
        if ref in self._starting:
            host = self._starting.pop(ref)
            try:
                self._infos[host] = ray.get(ref)
            except ray.exceptions.RayError as e:
                cause = getattr(e, "cause", None)
                # Deterministic faults (a checkpoint it cannot load, or changed since planning, a mesh or model it
                # cannot run, a run directory it cannot see, a host KV pool larger than the host's memory): every
                # slice and every restart would fail the same way.
                fatal = isinstance(cause, (CheckpointError, MeshError, UnsupportedModelError, RunDirUnreachable,
                                           PoolTooLarge, WeightsChanged))
                return GangEvent("failed", reason=f"could not start: {cause if fatal else _error_text(e)}", fatal=fatal)
            if self._starting:
                return GangEvent("waiting")
            self._polls = {a.poll.remote(POLL_S): host for host, a in enumerate(self.actors)}
            self._since = time.monotonic()
            return GangEvent("started", info=self._summary())
        host = self._polls.pop(ref)
        try:
            results, steps, samples_finished = ray.get(ref)
        except ray.exceptions.RayError as e:
            where = f" (host {host})" if self.num_hosts > 1 else ""
            return GangEvent("failed", reason=f"died{where}: {_error_text(e)}")
        self._polls[self.actors[host].poll.remote(POLL_S)] = host
        if self._host_level:  # independent hosts: each returns its own results and counts its own samples
            self._host_finished[host] = samples_finished
            if steps != self._host_steps[host]:
                self._host_steps[host], self._since = steps, time.monotonic()
            return GangEvent("results", results=results)
        if host == 0:
            self._host_finished[0] = samples_finished
            if steps != self._steps:
                self._steps, self._since = steps, time.monotonic()
        return GangEvent("results", results=results) if host == 0 else GangEvent("waiting")

    def timed_out(self, holding_batches: bool) -> str | None:
        """Why the slice counts as hung, or None."""
        limit = self.cfg.cluster.host_timeout_s
        idle = time.monotonic() - self._since
        if (self._starting or self._locating is not None) and idle > limit:
            return f"did not start within {limit:.0f} s (cluster.host_timeout_s)"
        if holding_batches and idle > limit:
            return f"took no engine step for {idle:.0f} s while holding batches (cluster.host_timeout_s)"
        return None

    @property
    def run_dir(self):
        """The run directory as a slice names it (absolute: a slice's working directory is not the head's)."""
        root = location.location(self.cfg.resolved_run_dir)
        return RunDir(root if isinstance(root, location.Location) else root.absolute())

    @property
    def _weights(self) -> dict | None:
        """run.json's record of the weight files, which every host checks before it loads the model."""
        run_dir = self.run_dir
        return run_dir.read_run_json().get("weights") if run_dir.run_json.exists() else None

    @property
    def pids(self) -> list[int]:
        """The started hosts' process ids, in host order."""
        return [self._infos[h]["pid"] for h in sorted(self._infos)]

    @property
    def samples_held(self) -> int:
        """Samples sent to the slice's current actors and not known to have finished (an upper bound on its queue)."""
        return sum(self._host_sent) - sum(self._host_finished)

    def submit(self, batch_id: str, attempt: int, num_prompts: int, num_samples: int) -> None:
        """Send the slice a reference to the batch's file; the slice reads the prompts itself."""
        budget = self.cfg.samples_in_flight_per_slice
        host = min(range(self.num_hosts), key=lambda h: (self._host_sent[h] - self._host_finished[h], h)) \
            if self._host_level else 0  # host-level: to the host holding the fewest unfinished samples
        share = max(1, budget // self.num_hosts) if self._host_level else budget
        self._host_sent[host] += num_samples
        work = BatchWork(batch_id, attempt, str(self.run_dir.batch_file(batch_id)), num_prompts,
                         seq=self._host_batches[host], wake_at=self._host_sent[host] - share + 1,
                         num_samples=num_samples)
        self._host_batches[host] += 1
        for actor in [self.actors[host]] if self._host_level else self.actors:  # SPMD: every host the same batch
            actor.submit.remote(work)

    def kill(self) -> None:
        import ray

        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        for group in (self.placement_group, self._head_group):
            if group is not None:
                try:
                    ray.util.remove_placement_group(group)
                except Exception:  # noqa: BLE001
                    pass
        self.actors, self.placement_group, self._head_group, self._starting, self._polls = [], None, None, {}, {}
        self._locating = None

    def _summary(self) -> dict:
        infos = [self._infos[h] for h in sorted(self._infos)]
        first = infos[0] if infos else {}
        return {"pids": [i.get("pid") for i in infos],
                "devices": sum(len(i.get("devices", [])) for i in infos) if self._host_level
                else len(first.get("devices", [])),
                "engines": sum(i.get("engines", 1) for i in infos) if self._host_level else first.get("engines", 1),
                "processes": [i.get("processes", 1) for i in infos],
                "load_s": max((i.get("load_s", 0.0) for i in infos), default=0.0),
                "model_bytes_read": sum(i.get("model_bytes_read", 0) for i in infos),
                "modules": sorted({m for i in infos for m in i.get("modules", [])}),
                **({"pod_slice": self._slice_name} if self._slice_name else {})}


def _error_text(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[-1] if text else type(e).__name__
