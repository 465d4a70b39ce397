"""What a slice runs and on which devices: `SliceSpec`, the plain data the head sends each host actor, and the
device mesh of an engine it builds from it."""

from __future__ import annotations

from dataclasses import dataclass, field

import engine as lazy_engine  # slice_mesh loads JAX on first use, never in the head
from engine import EngineConfig, SamplingConfig
from orchestrator.slices.cluster import engines_per_host, spmd


@dataclass(frozen=True)
class SliceSpec:
    """Everything a slice needs to build its engine (plain data, sent to the actor)."""

    name: str
    model_path: str
    tokenizer_path: str
    dtype: str
    engine: EngineConfig
    sampling: SamplingConfig
    mesh: dict[str, int] = field(default_factory=lambda: {"model": 1})
    num_hosts: int = 1
    """Host processes of this slice; more than one runs the engine as one SPMD program across them."""
    host_index: int = 0
    """This host's place in the slice; host 0 is the jax.distributed coordinator and returns the results."""
    devices_per_host: int | None = None
    """CPU slices: XLA host devices this process exposes."""
    model_cache_dir: str | None = None
    """model.cache_dir: where a gs:// checkpoint is copied on this host before loading."""
    batches_dir: str | None = None
    """The run directory's batches/, checked at start: a host that cannot see it fails the slice's start."""
    device_offset: int = 0
    weights: dict | None = None
    """run.json's record of the weight files (plan.weights_identity), checked before the model loads; None: not
    recorded (a run planned before weights were recorded)."""
    """An engine of a data-parallel slice: its first device on this host (it runs on [offset, offset + model))."""

    @property
    def engines(self) -> int:
        """Independent engines in this host's process (orchestrator.slices.cluster.engines_per_host)."""
        return engines_per_host(self.mesh, self.num_hosts)

    @property
    def spmd(self) -> bool:
        """One engine over every host of the slice (orchestrator.slices.cluster.spmd)."""
        return spmd(self.mesh, self.num_hosts)


def engine_mesh(spec: SliceSpec, lane: bool):
    """The mesh of the engine `spec` describes: every device of every host (SPMD), none (one device, one engine),
    or, for an engine of a data-parallel slice (`lane`), its `model` devices from `spec.device_offset` on."""
    width, first = spec.mesh.get("model", 1), spec.device_offset
    if spec.spmd:
        return lazy_engine.slice_mesh(width)  # every device of every host: one SPMD program
    if width == 1 and not lane:
        return None
    import jax
    import numpy as np
    from jax.sharding import Mesh

    devices = jax.devices()
    if len(devices) < first + width:
        raise ValueError(f"cluster.mesh data={spec.engines} x model={width} needs {spec.engines * width} "
                         f"devices but this host has {len(devices)}; lower the mesh or set cluster.devices_per_host")
    return Mesh(np.asarray(devices[first:first + width]).reshape(1, width), ("data", "model"))
