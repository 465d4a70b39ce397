"""`pagefleet check CONFIG.yaml [--target tpu-v5p|tpu-v6e|tpu-v5e|cpu]`: pre-flight without the accelerator.

Three questions, answered on any machine before a slice is rented, each by the code that owns it:

1. Does the head accept the config? The head's own checks (`load_run_config`, then `slice_layout.validate`:
   the mesh against the slice's devices and the model's heads and MLP width, `PackingLimits.resolve`, the
   context length and the KV pool), nothing re-derived.
2. Do the engine's step programs compile for the target? Every program at every shape bucket is traced
   and lowered for TPU on an abstract mesh of the slice's devices (`engine/sizing/preflight.py`), the Pallas
   kernel included; the kernel's block sizes and VMEM estimate come with each (`engine/kernels/pallas_blocks.py`).
3. Does it fit? Per chip: weights, KV pool and an activation estimate against the chip's HBM, with
   `orchestrator/plan/size.py`'s chip table and formulas; the kernel's VMEM against a TensorCore's VMEM.

Exit 0 when all hold; exit 2 (`exit_codes.FAULT`), with the numbers, when one does not.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

from engine import (DTYPE_BYTES, TPU_TARGETS as TPUS, GiB, LoweringFailed, abstract_mesh, count_params, kv_page_bytes,
                    lower_step_programs, sampling_mode, sharded_config)
from orchestrator.config import ConfigError, load_run_config
from orchestrator.plan.planner import refuse_bad_prompt_settings
from orchestrator.plan.size import CHIPS, activation_bytes_per_chip
from orchestrator.slices.cluster import engines_per_slice, spmd
from orchestrator.slices.slice_layout import validate

TARGETS = ("tpu-v5p", "tpu-v6e", "tpu-v5e", "cpu")
MiB = 2**20


@dataclass(frozen=True)
class Fit:
    """Per-chip memory of one engine, in bytes."""

    weights: int
    kv_pool: int
    activations: int
    hbm: int | None
    """The chip's HBM; None for the cpu target (no chip to compare with)."""

    @property
    def total(self) -> int:
        return self.weights + self.kv_pool + self.activations


class Refused(ValueError):
    """The config will not compile or fit; the message gives the numbers and the key to change."""


def default_target(slice_head_resource: str | None) -> str:
    """The TPU named by cluster.slice_head_resource ("TPU-v5p-16-head" -> tpu-v5p), else cpu."""
    match = re.match(r"TPU-(v\d+[a-z]*)-", slice_head_resource or "")
    return f"tpu-{match.group(1)}" if match and f"tpu-{match.group(1)}" in TARGETS else "cpu"


def run_check(config_path: str, overrides: list[str], target: str | None) -> str:
    """The pre-flight's report; raises `Refused` for a config the head rejects or that will not compile or fit."""
    try:
        cfg = load_run_config(config_path, overrides)
        model_cfg, context = head_validation(cfg)
        refuse_bad_prompt_settings(cfg)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        raise Refused(f"the head rejects the config: {e}") from None
    target = target or default_target(cfg.cluster.slice_head_resource)
    lines = [f"config: {config_path} ({cfg.model.path}, {cfg.model.dtype}); target {target}",
             "head validation: ok (config keys, cluster layout, packing limits, model config.json)"]

    chip = target.removeprefix("tpu-") if target != "cpu" else None
    tp = cfg.cluster.mesh.get("model", 1)
    # The engine's mesh (orchestrator/slices/slice_spec.py's engine_mesh): an SPMD multi-host slice's every
    # device; else `tp` devices of one host, for each of the slice's cluster.mesh.data engines.

    cluster = cfg.cluster
    one_program = spmd(cluster.mesh, cluster.hosts_per_slice)
    devices = cluster.hosts_per_slice * (cluster.devices_per_host or tp) if one_program else tp
    mesh = abstract_mesh(devices, tp, TPUS[chip] if chip else None)
    platform = "tpu" if chip else "cpu"
    engines = engines_per_slice(cluster.mesh, cluster.hosts_per_slice)
    lines.append(f"mesh: {devices} devices, data {devices // tp} x model {tp}"
                 + (f" (each of the slice's {engines} engines)" if engines > 1 else "")
                 + (f", JAX device kind {mesh.abstract_device.device_kind!r}" if chip else ""))
    started = time.perf_counter()
    try:
        programs = lower_step_programs(model_cfg, cfg.engine, context, cfg.model.dtype,
                                       sampling_mode(cfg.sampling, model_cfg.vocab_size),
                                       len(set(model_cfg.eos_token_ids) | set(cfg.sampling.stop_token_ids)), mesh,
                                       platform)
    except (LoweringFailed, ValueError) as e:
        raise Refused(f"{e}") from None
    lines.append(f"step programs: {len(programs)} lowered for {platform} in {time.perf_counter() - started:.1f} s")
    for p in programs:
        kernel = (f"  kernel blocks {p.kernel.kv_pages_per_block} KV pages x {p.kernel.queries_per_block} queries, "
                  f"VMEM {p.kernel.vmem_bytes / MiB:.2f} MiB" if p.kernel else "")
        lines.append(f"  {p.name:<10} T={p.tokens:<6} S={p.seqs:<5}{kernel}")
    problems = []
    if chip:
        vmem = TPUS[chip].vmem_bytes_per_core
        worst = max((p for p in programs if p.kernel), key=lambda p: p.kernel.vmem_bytes)
        lines.append(f"Pallas kernel VMEM: at most {worst.kernel.vmem_bytes / MiB:.2f} MiB of {vmem / MiB:.0f} MiB per "
                     f"TensorCore ({worst.name} T={worst.tokens}: {worst.kernel.kv_pages_per_block} pages of "
                     f"{cfg.engine.page_size} tokens x {worst.kernel.queries_per_block} queries per block)")
        if worst.kernel.vmem_bytes > vmem:
            problems.append(f"the Pallas kernel's blocks need {worst.kernel.vmem_bytes / MiB:.2f} MiB of VMEM, the "
                            f"{chip} has {vmem / MiB:.0f} MiB per TensorCore; lower engine.page_size")
    fit = memory_fit(cfg, model_cfg, tp, chip, max(p.tokens for p in programs), max(p.seqs for p in programs))
    lines.append(f"HBM per chip: weights {fit.weights / GiB:.2f} GiB + KV pool {fit.kv_pool / GiB:.2f} GiB "
                 f"({cfg.engine.max_pages:,} pages of {cfg.engine.page_size} tokens) + activations ~"
                 f"{fit.activations / GiB:.2f} GiB = {fit.total / GiB:.2f} GiB"
                 + (f" of {fit.hbm / GiB:.2f} GiB ({fit.total / fit.hbm:.0%})" if fit.hbm else ""))
    if fit.hbm is not None and fit.total > fit.hbm:
        problems.append(f"{fit.total / GiB:.2f} GiB per chip exceeds the {chip}'s {fit.hbm / GiB:.2f} GiB of HBM; "
                        "lower engine.max_pages (`pagefleet size` gives the largest that fits) or raise cluster.mesh.model")
    if problems:
        raise Refused("\n".join(lines + problems))
    return "\n".join(lines + ["ok: the config passes the head's checks, compiles for the target and fits"])


def head_validation(cfg):
    """The head's checks of a loaded config, as `pagefleet run` makes them (`orchestrator/slices/slice_layout.py`);
    returns the model's config and the engine's context length. Raises ValueError or FileNotFoundError naming
    the key."""
    return validate(cfg)


def memory_fit(cfg, model_cfg, tp: int, chip: str | None, tokens: int, seqs: int) -> Fit:
    """Per-chip weights, KV pool and activations (`orchestrator/plan/size.py`'s formulas) and the chip's HBM."""
    model_cfg = sharded_config(model_cfg, tp)  # as the engine holds it: KV heads replicated when tp exceeds them
    nbytes = DTYPE_BYTES[cfg.model.dtype]
    kv_pool = cfg.engine.max_pages * kv_page_bytes(model_cfg, nbytes, cfg.engine.page_size, tp)
    return Fit(weights=count_params(model_cfg).per_chip(tp) * nbytes, kv_pool=kv_pool,
               activations=activation_bytes_per_chip(model_cfg, tokens, seqs, tp),
               hbm=int(CHIPS[chip].hbm_gib * GiB) if chip else None)
