"""Planning a run: read and tokenize the corpus on Ray, pack, and write the run directory.

Streaming: Ray Data tokenizes shard by shard into the object store (spilling to disk when large);
the head only pulls per-row summaries (row, id, token count, reason), packs them, and Ray workers
then group the token ids by batch and write one parquet file per batch. The head never holds the
token ids.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from orchestrator.storage import location, object_append, storage
from orchestrator.config import RunConfig
from orchestrator.plan.corpus import corpus_fingerprint, count_rows, list_files, number_shards, split_shards
from orchestrator.json_out import dumps
from orchestrator.run.lock import run_lock
from orchestrator.run.manifest import BatchRecord, batch_id, write_manifest
from orchestrator.plan.model_source import decoder_config, max_seq_len, model_fingerprint, tokenizer_fingerprint
from orchestrator.plan.packing import PackingLimits, lower_bound, pack, shareable_prompt_tokens
from orchestrator.plan.report import PlanStats
from orchestrator.plan.output_plan import first_foreign, plan_fingerprint
from orchestrator.plan.weights_identity import check_weights, weights_digest, weights_identity
from orchestrator.run.rundir import PlanMismatch, RunDir, check_same_plan, config_hash, versions
from orchestrator.storage.atomic import atomic_write_parquet, atomic_write_text
from orchestrator.plan.tokenize import PromptTokenizer, shard_item
from orchestrator.surface import setting

log = logging.getLogger(__name__)

SUMMARY_COLUMNS = ["row", "prompt_id", "num_tokens", "reason", "detail", "file_index", "line", "page_keys",
                   "max_new_tokens"]
BATCH_SCHEMA = pa.schema([("prompt_id", pa.string()), ("row", pa.int64()), ("token_ids", pa.list_(pa.int32())),
                          ("passthrough", pa.string()), ("sampling", pa.string())])
"""batches/<id>.parquet. `passthrough` (SampleRecord.passthrough: the row's other columns and typed id) and
`sampling` (the row's own sampling overrides, orchestrator.plan.row_sampling) are absent from plans older than them."""


class NothingToRun(ValueError):
    """The run can produce no sample: an empty corpus, every row rejected, or a config that no prompt fits.
    The message is one line that names the cause and the fix."""


@dataclass(frozen=True)
class PlanResult:
    run_dir: Path
    stats: PlanStats
    already_planned: bool


def fingerprints(cfg: RunConfig, files: list[str]) -> dict[str, str]:
    return {
        "config": config_hash(cfg.sample_affecting()),
        "corpus": corpus_fingerprint(files),
        "tokenizer": tokenizer_fingerprint(cfg.model),
        "model": model_fingerprint(cfg.model),
    }


def plan(cfg: RunConfig) -> PlanResult:
    """Plan `cfg` into its run directory, or check that the existing plan matches it."""
    if not RunDir(location.location(cfg.resolved_run_dir)).is_planned():
        refuse_impossible(cfg)
    with run_lock(cfg.resolved_run_dir, cfg.lock_stale_s):
        return plan_locked(cfg)


def refuse_impossible(cfg: RunConfig) -> None:
    """Raise NothingToRun for a run that cannot produce a sample, found without Ray and before the run
    directory exists: a corpus whose files are all empty, or limits that even a one-token prompt exceeds."""
    cfg.model.require_path()  # the inputs in the order plan_locked checks them
    files = list_files(cfg.corpus.path)
    if all(_is_empty(f) for f in files):
        raise NothingToRun(f"corpus.path {cfg.corpus.path!r} is empty ({len(files)} file(s) of 0 bytes); "
                           f"point {setting('corpus.path', 'FILE')} at a file with at least one prompt")
    limits = PackingLimits.resolve(cfg.packing, cfg.engine, cfg.sampling)
    context = max_seq_len(cfg.model, cfg.engine)
    new = cfg.sampling.max_new_tokens
    if 1 + new > context:
        raise NothingToRun(f"no prompt can fit: sampling.max_new_tokens={new:,} plus a one-token prompt exceeds "
                           f"the model's context of {context:,} tokens (engine.max_seq_len, else the model's "
                           f"max_position_embeddings); lower sampling.max_new_tokens below {context:,}")
    if (why := limits.why_unfit(1)) is not None:
        raise NothingToRun(f"no prompt can fit: even a one-token prompt {why}; lower sampling.max_new_tokens or "
                           "sampling.n, or raise the budget")


def _is_empty(url: str) -> bool:
    import fsspec

    fs, path = fsspec.core.url_to_fs(url)
    try:
        return fs.size(path) == 0
    except OSError:
        return False  # unreadable here: the planner's reading reports it


def plan_locked(cfg: RunConfig) -> PlanResult:
    """`plan` for a caller that already holds the run directory's lock (`pagefleet run`)."""
    run_dir = RunDir(location.location(cfg.resolved_run_dir))
    cfg.model.require_path()
    files = list_files(cfg.corpus.path)
    prints = fingerprints(cfg, files)
    if run_dir.is_planned():
        check_same_plan(run_dir, cfg, prints)
        recorded = run_dir.read_run_json().get("weights")
        if recorded is not None:  # absent in runs planned before weights were recorded
            check_weights(cfg.model.require_path(), recorded)
        stats = PlanStats.from_json(run_dir.read_run_json()["plan"])
        if stats.accepted == 0:  # planned before such plans were refused
            raise NothingToRun(_nothing_accepted(stats, run_dir, cfg))
        return PlanResult(run_dir.root, stats, True)
    weights = weights_identity(cfg.model.require_path())
    prints["weights"] = weights_digest(weights)
    _refuse_foreign_outputs(run_dir, plan_fingerprint(prints))
    stats, records = _plan_into(cfg, run_dir, files)
    if stats.accepted == 0:  # rejected.jsonl stays for the user to read; no plan, so a fixed corpus replans
        shutil.rmtree(run_dir.batches, ignore_errors=True)
        with object_append.open_append(run_dir.events) as events:
            events.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S%z')} not planned: {_nothing_accepted(stats, run_dir, cfg)}\n")
        raise NothingToRun(_nothing_accepted(stats, run_dir, cfg))
    run_dir.write_run_json({
        "name": cfg.name,
        "config": json.loads(json.dumps(dataclasses.asdict(cfg))),
        "sample_affecting": cfg.sample_affecting(),
        "capacities": cfg.capacities(),
        "fingerprints": prints,
        "weights": weights,
        "corpus_files": files,
        "versions": versions(),
        "plan": stats.to_json(),
    })
    write_manifest(run_dir.manifest, records)
    with object_append.open_append(run_dir.events) as events:
        events.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S%z')} planned {stats.num_batches} batches: "
                     f"{stats.accepted} prompts accepted, {stats.rows_read - stats.accepted} rejected\n")
    return PlanResult(run_dir.root, stats, False)


def _refuse_foreign_outputs(run_dir: RunDir, plan: str) -> None:
    """Planning afresh into a directory that holds outputs of another plan (run.json removed, then another seed or
    corpus) must not adopt them: refuse before any work, naming the fix."""
    foreign = first_foreign(run_dir.outputs, plan)
    if foreign is not None:
        count = len(list(run_dir.outputs.glob("*.parquet")))
        raise PlanMismatch(f"{foreign} (one of {count} output files in {run_dir.outputs}) was not computed for this "
                           f"plan (config, corpus, tokenizer or model); use a new run directory ({setting('run_dir', 'DIR')} or "
                           f"{setting('name', 'NAME')}), or remove {run_dir.outputs} to recompute every batch")


def _nothing_accepted(stats: PlanStats, run_dir: RunDir, cfg: RunConfig) -> str:
    if stats.rows_read == 0:
        return f"the corpus holds no rows; point {setting('corpus.path', 'FILE')} at a file with at least one prompt"
    reasons = ", ".join(f"{count:,} {reason}" for reason, count in stats.rejected.items())
    fix = ""
    if stats.rejected.get("missing_field") == stats.rows_read:  # the corpus names its fields otherwise
        fields = [f"corpus.text_field={cfg.corpus.text_field!r}"]
        if cfg.corpus.messages_field:
            fields.append(f"corpus.messages_field={cfg.corpus.messages_field!r}")
        fix = (f"; no row has the field {' or '.join(fields)} names: set "
               f"{setting('corpus.text_field', 'FIELD')} to the corpus's own field")
    return (f"no prompt accepted: all {stats.rows_read:,} rows were rejected ({reasons}){fix}; each row's reason is "
            f"in {run_dir.rejected}")


def _plan_into(cfg: RunConfig, run_dir: RunDir, files: list[str]) -> tuple[PlanStats, list[BatchRecord]]:
    import ray
    from ray.data import DataContext

    from orchestrator.slices.cluster import ensure_ray
    from orchestrator.observe.ray_noise import quiet_ray_data

    ensure_ray(cfg.cluster)
    quiet_ray_data()
    data_context = DataContext.get_current()
    data_context.enable_progress_bars = False  # the capacity report is the output; phases are logged
    data_context.print_on_execution_start = False
    limits = PackingLimits.resolve(cfg.packing, cfg.engine, cfg.sampling)
    context = max_seq_len(cfg.model, cfg.engine)
    if run_dir.batches.exists():  # leftovers of an interrupted plan
        storage.remove_tree(run_dir.batches)
    run_dir.batches.mkdir(parents=True)

    clock = time.perf_counter()

    def phase(name: str) -> None:
        nonlocal clock
        log.info("plan: %s took %.2f s", name, time.perf_counter() - clock)
        clock = time.perf_counter()

    shards = split_shards(files, cfg.corpus.shard_bytes)
    count = ray.remote(num_cpus=1)(count_rows)
    counts = ray.get([count.remote(s) for s in shards])
    shards = number_shards(shards, counts)
    phase(f"counting rows of {len(shards)} shards")
    if sum(rows for rows, _ in counts) == 0:  # e.g. only blank lines: nothing to tokenize
        return PlanStats.build(0, [], np.zeros(0, np.int64), pack(np.zeros(0, np.int64), limits), 0), []
    workers = max(1, min(len(shards), int(ray.available_resources().get("CPU", 1))))
    with warnings.catch_warnings():  # max_restarts has no named parameter in map_batches (Ray 2.60)
        warnings.filterwarnings("ignore", message=".*ray_remote_args.*deprecated")
        tokenized = ray.data.from_items([shard_item(s) for s in shards], override_num_blocks=len(shards)).map_batches(
            PromptTokenizer, fn_constructor_args=(cfg.model, cfg.corpus, limits, context,
                                                  decoder_config(cfg.model).get("vocab_size"), cfg.sampling),
            batch_size=1, compute=ray.data.ActorPoolStrategy(size=workers), batch_format="numpy",
            # No actor restarts: Ray Data hands its actors their arguments as object refs, which a restart may not
            # recover (Ray says so in an E-level core_worker line on every plan). A lost tokenizer fails the plan,
            # and rerunning plans afresh.
            max_restarts=0,
        ).materialize()

    phase("tokenizing")
    summary = _summaries(tokenized)
    summary = _reject_duplicates(summary)
    accepted = summary.filter(pc.is_null(summary["reason"]))
    rejected = summary.filter(pc.is_valid(summary["reason"]))
    _write_rejected(run_dir, rejected, files)
    lengths = accepted["num_tokens"].to_numpy().astype(np.int64)
    new_tokens = accepted["max_new_tokens"].to_numpy().astype(np.int64)
    if (new_tokens == limits.max_new_tokens).all():  # no row sets its own: the run's, as packing defaults to
        new_tokens = None
    phase("collecting summaries and rejections")
    first_keys, all_keys = _page_keys(accepted)
    packing = pack(lengths, limits, first_keys, new_tokens)
    num_batches = packing.num_batches

    rows = accepted["row"].to_numpy()
    num_rows = summary.num_rows
    batch_of_row = np.full(num_rows, -1, dtype=np.int32)  # summary rows are 0..num_rows-1 in order
    position_of_row = np.zeros(num_rows, dtype=np.int32)
    batch_of_row[rows] = packing.batch_of_item()
    position_of_row[rows[packing.order]] = np.arange(len(packing.order), dtype=np.int32)
    phase(f"packing into {packing.num_batches} batches")
    # Hash partitions of about 32 MiB of token ids each, at least one per worker.
    partitions = max(workers, min(256, int(lengths.sum()) * 4 // 2**25))
    _write_batch_files(tokenized, ray.put((batch_of_row, position_of_row)), str(run_dir.batches), num_batches,
                       min(partitions, max(1, num_batches)))

    phase(f"writing {num_batches} batch files")
    records = [
        BatchRecord(batch_id(b, num_batches), num_prompts=int(packing.offsets[b + 1] - packing.offsets[b]),
                    num_prompt_tokens=int(packing.num_prompt_tokens[b]), num_pages=int(packing.num_pages[b]))
        for b in range(num_batches)
    ]
    stats = PlanStats.build(num_rows, rejected["reason"].to_pylist(), lengths, packing,
                            lower_bound(lengths, limits, new_tokens),
                            shareable_prompt_tokens(all_keys, limits.page_size))
    return stats, records


def _page_keys(accepted: pa.Table) -> tuple[np.ndarray, np.ndarray]:
    """(u64[prompts]: each accepted prompt's first leading-page key, 0 for none; u64[pages]: all their keys)."""
    keys = accepted["page_keys"]
    counts = pc.list_value_length(keys).to_numpy(zero_copy_only=False).astype(np.int64)
    flat = np.asarray(pc.list_flatten(keys).to_numpy(zero_copy_only=False), dtype=np.uint64)
    first = np.zeros(len(counts), dtype=np.uint64)
    has = counts > 0
    first[has] = flat[(np.cumsum(counts) - counts)[has]]
    return first, flat


def _summaries(tokenized) -> pa.Table:
    parts = list(tokenized.select_columns(SUMMARY_COLUMNS).iter_batches(batch_format="pyarrow", batch_size=None))
    table = pa.concat_tables(parts) if parts else pa.table({c: [] for c in SUMMARY_COLUMNS})
    table = table.sort_by("row")
    if not np.array_equal(table["row"].to_numpy(), np.arange(table.num_rows)):
        raise RuntimeError("internal error: corpus rows were lost or duplicated while tokenizing")
    return table


def _reject_duplicates(summary: pa.Table) -> pa.Table:
    """A prompt id seen before (in corpus order) rejects the later row: ids must be unique."""
    ok = pc.is_null(summary["reason"])
    ids = summary["prompt_id"].combine_chunks()
    first = pa.table({"id": ids, "row": summary["row"]}).filter(ok).group_by("id", use_threads=False).aggregate([("row", "min")])
    if first.num_rows == int(pc.sum(ok.cast(pa.int64())).as_py() or 0):
        return summary
    first_row = dict(zip(first["id"].to_pylist(), first["row_min"].to_pylist()))
    reasons, details = summary["reason"].to_pylist(), summary["detail"].to_pylist()
    for i, (pid, reason) in enumerate(zip(ids.to_pylist(), reasons)):
        if reason is None and first_row[pid] != i:
            reasons[i], details[i] = "duplicate_id", f"prompt id {pid!r} already used by row {first_row[pid]}"
    return summary.set_column(summary.schema.get_field_index("reason"), "reason", pa.array(reasons, pa.string())) \
        .set_column(summary.schema.get_field_index("detail"), "detail", pa.array(details, pa.string()))


def _write_rejected(run_dir: RunDir, rejected: pa.Table, files: list[str]) -> None:
    lines = [dumps({"row": r["row"], "prompt_id": r["prompt_id"], "reason": r["reason"], "detail": r["detail"],
                         "file": files[r["file_index"]], "line": r["line"], "num_tokens": r["num_tokens"] or None})
             for r in rejected.to_pylist()]
    atomic_write_text(run_dir.rejected, "".join(line + "\n" for line in lines))


def _write_batch_files(tokenized, assignment_ref, batches_dir: str, num_batches: int, partitions: int) -> None:
    """Group token ids by batch on Ray workers and write batches/<id>.parquet, prompts longest first."""
    if num_batches == 0:
        return

    def assign(table: pa.Table) -> pa.Table:
        import ray

        batch_of_row, position_of_row = ray.get(assignment_ref)
        rows = table["row"].to_numpy()
        table = table.select(BATCH_SCHEMA.names)
        table = table.append_column("batch", pa.array(batch_of_row[rows]))
        table = table.append_column("position", pa.array(position_of_row[rows]))
        return table.filter(pc.greater_equal(table["batch"], 0))

    def write(group: pa.Table) -> pa.Table:
        group = group.sort_by("position")
        index = int(group["batch"][0].as_py())
        path = f"{batches_dir}/{batch_id(index, num_batches)}.parquet"
        atomic_write_parquet(path, group.select(BATCH_SCHEMA.names).cast(BATCH_SCHEMA), fsync=False)
        return pa.table({"batch": [index], "num_prompts": [group.num_rows]})

    written = tokenized.map_batches(assign, batch_format="pyarrow", batch_size=None) \
        .groupby("batch", num_partitions=partitions).map_groups(write, batch_format="pyarrow")
    count = sum(t.num_rows for t in written.iter_batches(batch_format="pyarrow", batch_size=None))
    if count != num_batches:
        raise RuntimeError(f"internal error: wrote {count} batch files for {num_batches} batches")
    os.sync()  # one durability barrier for every batch file, before the manifest refers to them
