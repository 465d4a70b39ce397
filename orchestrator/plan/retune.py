"""Resuming a run with other capacities (engine.max_seqs, max_pages, max_seqs_in_prefill, max_prefill_size,
packing.*): samples do not depend on them, so the plan stays; pending batches that no longer fit are re-packed.

Done batches keep their ids and outputs. When any pending batch exceeds the new budgets, every pending
prompt is packed afresh into new batches, named `<old-style id>-r<g>` for the g-th re-pack, so that no new
id can meet an output written for an old one. Crash safety, in write order: the new batch files (not yet
referenced), then the manifest (atomic: old pending batches out, new ones in), then run.json's capacities,
then the old batch files are deleted. A crash before the manifest leaves the old plan (the next start
re-packs again, to the same ids); after it, the new batches fit and only run.json is brought up to date.
"""

from __future__ import annotations

import re

import numpy as np
import pyarrow as pa

from engine import SamplingConfig
from orchestrator.config import RunConfig, diff_keys
from orchestrator.plan.continuation import batch_samples, new_tokens
from orchestrator.plan.model_source import kv_groups
from orchestrator.plan.packing import PackingLimits, pack
from orchestrator.plan.row_sampling import max_new_tokens
from orchestrator.state.manifest import BatchRecord, batch_id
from orchestrator.state.run_state import RunState
from orchestrator.state.rundir import PlanMismatch, RunDir
from orchestrator.storage import parquet_io
from orchestrator.storage.atomic import atomic_write_parquet
from orchestrator.surface import setting

_GENERATION = re.compile(r"-r(\d+)$")


def planned_capacities(info: dict) -> dict:
    """The capacities a run.json's batches were packed for (older plans kept them in `sample_affecting`)."""
    if "capacities" in info:
        planned = {section: dict(values) for section, values in info["capacities"].items()}
    else:
        old = info["sample_affecting"]
        engine = {k: old.get("engine", {}).get(k) for k in ("max_pages", "max_seqs", "max_seqs_in_prefill",
                                                             "max_prefill_size")}
        planned = {"engine": engine, "packing": old.get("packing", {})}
    for key, value in RunConfig().capacities()["engine"].items():  # keys newer than the plan: their defaults
        planned["engine"].setdefault(key, value)
    return planned


def retune(run_dir: RunDir, state: RunState, cfg: RunConfig) -> str | None:
    """Bring a recovered run to `cfg`'s capacities; raises PlanMismatch when a pending prompt cannot fit them.
    Returns what changed (the line written to events.log, for the console too), or None when nothing did."""
    info = run_dir.read_run_json()
    changes = diff_keys(planned_capacities(info), cfg.capacities())
    if not changes:
        return None
    limits = PackingLimits.resolve(cfg.packing, cfg.engine, cfg.sampling, kv_groups(cfg.model, cfg.engine))
    pending = state.with_status("pending")
    tables = {r.batch_id: parquet_io.read_parquet(run_dir.batch_file(r.batch_id)) for r in pending}
    demand = {b: _demand(table, cfg.sampling, limits) for b, table in tables.items()}
    for b, table in tables.items():
        for pid, *need in zip(table.column("prompt_id").to_pylist(), *(d.tolist() for d in demand[b])):
            if (why := limits.why_unfit(*need)) is not None:
                raise PlanMismatch(f"run directory {run_dir.root}: pending prompt {pid!r} no longer fits a batch with "
                                   f"{', '.join(changes)}: it {why}; resume with capacities that hold it, or start "
                                   f"a new run with {setting('name', 'NAME')}")
    misfits = [b for b in tables if not _fits(*demand[b], limits)]
    what = "; ".join(changes)
    if misfits:
        message = _repack(run_dir, state, tables, limits, cfg.sampling, what, len(misfits))
    else:
        message = f"capacities changed ({what}); the {len(pending)} pending batches fit them as they are"
        state.event(message)
    info["capacities"] = cfg.capacities()
    run_dir.write_run_json(info)
    if misfits:
        for b in tables:  # the old pending batches: no longer referenced by the manifest
            run_dir.batch_file(b).unlink(missing_ok=True)
    return message


def _demand(prompts: pa.Table, sampling: SamplingConfig, limits: PackingLimits) -> tuple[np.ndarray, ...]:
    """i64[prompts] each: a batch table's prompt lengths, max_new_tokens, continuations (0 for a sampled row) and
    prefill tokens, as the planner measures them (a scored row by continuation.new_tokens and limits.scored_prefill)."""
    tokens = prompts.column("token_ids").to_pylist()
    scored = (prompts.column("continuations").to_pylist() if "continuations" in prompts.column_names
              else [None] * len(tokens))
    new = max_new_tokens(prompts, sampling)
    return (np.array([len(t) for t in tokens], dtype=np.int64),
            np.array([n if not c else new_tokens(c) for n, c in zip(new.tolist(), scored)], dtype=np.int64),
            np.array([len(c or ()) for c in scored], dtype=np.int64),
            np.array([len(t) if not c else limits.scored_prefill(t, c) for t, c in zip(tokens, scored)], dtype=np.int64))


def _fits(lengths: np.ndarray, new: np.ndarray, continuations: np.ndarray, prefill: np.ndarray,
          limits: PackingLimits) -> bool:
    units = int(np.sum(limits.units(continuations)))
    return (int(limits.page_need(lengths, new, continuations).sum()) <= limits.max_pages
            and int(prefill.sum()) <= limits.max_prompt_tokens
            and units * limits.n <= limits.max_seqs and units <= limits.max_prompts)


def _repack(run_dir: RunDir, state: RunState, tables: dict[str, pa.Table], limits: PackingLimits,
            sampling: SamplingConfig, what: str, num_misfits: int) -> str:
    prompts = pa.concat_tables(tables.values()).sort_by("row")  # corpus order: the packing's tie-break
    lengths, new, continuations, prefill = _demand(prompts, sampling, limits)
    packing = pack(lengths, limits, max_new_tokens=new, continuations=continuations, prefill_tokens=prefill)
    generation = 1 + max((int(m.group(1)) for b in state.batch_ids() if (m := _GENERATION.search(b))), default=0)
    records = []
    for b in range(packing.num_batches):
        new_id = f"{batch_id(b, packing.num_batches)}-r{generation}"
        atomic_write_parquet(run_dir.batch_file(new_id), prompts.take(pa.array(packing.batch(b))))
        records.append(BatchRecord(new_id, num_prompts=int(packing.offsets[b + 1] - packing.offsets[b]),
                                   num_prompt_tokens=int(packing.num_prompt_tokens[b]),
                                   num_pages=int(packing.num_pages[b]),
                                   expected_samples=batch_samples(continuations[packing.batch(b)])))
    state.replace_pending(records)
    message = (f"capacities changed ({what}): {num_misfits} of {len(tables)} pending batches no longer fit, so "
               f"their {prompts.num_rows} prompts were re-packed into {len(records)} batches (re-pack {generation})")
    state.event(message)
    state.flush(force=True)
    return message
