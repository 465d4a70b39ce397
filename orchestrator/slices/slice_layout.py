"""The head's validation of a slice's layout and engine capacities, before any slice starts.

`validate(cfg)` is what `pagefleet run` (the Driver, before planning) and `pagefleet check` run: the mesh against
the slice's devices and the model's config.json, and the engine's capacities against the model. Every error is a
ValueError of one line that names the key and the fix; `pagefleet` exits with `exit_codes.FAULT` on it, and no
slice is ever started (so nothing is retried).
"""

from __future__ import annotations

from engine import check_pool, ModelConfig, tensor_parallel_error
from orchestrator.config import RunConfig
from orchestrator.plan.model_source import generation_config, max_seq_len, model_config
from orchestrator.plan.packing import PackingLimits

MESH_AXES = ("data", "model")


def devices_per_host(cfg: RunConfig) -> int | None:
    """A host's devices as the head knows them: cluster.devices_per_host (CPU), else the TPU or GPU count that
    cluster.resources_per_host asks for; None when neither says."""
    cluster = cfg.cluster
    if cluster.devices_per_host:
        return cluster.devices_per_host
    for kind in ("TPU", "GPU"):
        count = cluster.resources_per_host.get(kind)
        if count and float(count).is_integer():
            return int(count)
    return None


def check_mesh(cfg: RunConfig) -> None:
    """The mesh against the slice's devices (no model needed)."""
    cluster = cfg.cluster
    unknown = sorted(set(cluster.mesh) - set(MESH_AXES))
    if unknown:
        raise ValueError(f"cluster.mesh has unknown axis {unknown[0]!r}; its axes are data (engines per slice) and "
                         "model (tensor-parallel width of each engine)")
    width, per_host = cluster.mesh.get("model", 1), devices_per_host(cfg)
    data, hosts = cluster.mesh.get("data", 1), cluster.hosts_per_slice
    if data > 1 and hosts > 1 and data % hosts:
        raise ValueError(f"cluster.mesh.data={data} does not divide over cluster.hosts_per_slice={hosts} hosts: each "
                         f"host runs data / hosts engines on its own devices; choose a multiple of {hosts}, or leave "
                         "data out for one engine over the whole slice")
    if per_host is None:
        return
    devices = cluster.hosts_per_slice * per_host
    where = (f"the slice's {devices} devices (cluster.hosts_per_slice={cluster.hosts_per_slice} x "
             f"{per_host} devices per host)")
    if "data" in cluster.mesh:
        data = cluster.mesh["data"]
        if data * width != devices:
            raise ValueError(f"cluster.mesh data={data} x model={width} = {data * width} devices, but {where}; "
                             f"choose data x model = {devices}")
    elif devices % width:
        raise ValueError(f"cluster.mesh.model={width} does not divide {where}")


def validate(cfg: RunConfig) -> tuple:
    """Every check of the head, in order; returns the model's config and the engine's context length."""
    check_mesh(cfg)
    PackingLimits.resolve(cfg.packing, cfg.engine, cfg.sampling)
    model = ModelConfig.from_hf(model_config(cfg.model), generation_config(cfg.model))
    width = cfg.cluster.mesh.get("model", 1)
    error = tensor_parallel_error(model, width)
    if error is not None:
        raise ValueError(f"cluster.mesh.model={width}: {error}")
    context = max_seq_len(cfg.model, cfg.engine)
    check_pool(cfg.engine, context)
    return model, context
