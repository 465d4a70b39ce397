"""Planning a run: read and tokenize the corpus, pack, and write the run directory.

Streaming, a window at a time: the corpus's rows are counted, then planned a window of rows at a time
(`corpus.window_rows`, fewer for long rows: `corpus.window_bytes`). A window of a large corpus is tokenized by Ray
Data shard by shard into the object store (spilling to disk when large); the head only pulls the window's per-row
summaries (row, id, token count, reason), packs them, and Ray workers then group the token ids by batch and write one
parquet file per batch, so the head never holds the token ids; then the next window. What the head keeps across windows is bounded: counts and per-batch figures for the report; the
accepted ids as digests (windows.py) and the batches' manifest lines go to local temporary files. A corpus of at most `corpus.in_process_bytes` goes through
the same steps in the head's own process (tokenized.py).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from engine import structured_error
from orchestrator.config import RunConfig, plan_changes
from orchestrator.json_out import dumps
from orchestrator.plan.chat import unread_kwargs
from orchestrator.plan.corpus import CorpusConfig, split_shards, window_shards
from orchestrator.plan.corpus_files import corpus_fingerprint, list_files
from orchestrator.plan.model_source import (decoder_config, kv_groups, load_tokenizer, max_seq_len, model_fingerprint,
                                            tokenizer_fingerprint)
from orchestrator.plan.continuation import batch_samples
from orchestrator.plan.packing import PackingLimits, bound_totals, pack, shareable_prompt_tokens
from orchestrator.plan.report import PlanStats, PlanTally
from orchestrator.plan.tokenized import (SUMMARY_COLUMNS, Assignment, InProcess, OnRay, corpus_bytes, count,
                                         tokenize)
from orchestrator.plan.windows import LineSpool, SeenIds
from orchestrator.plan.weights_identity import check_weights, weights_digest, weights_identity
from orchestrator.state.disk_full import disk_full
from orchestrator.state.faults import crash_point
from orchestrator.state.manifest import BatchRecord, batch_id, hold, write_manifest
from orchestrator.state.manifest_lines import ManifestLines
from orchestrator.state.output_plan import first_foreign, plan_fingerprint
from orchestrator.state.run_lock import run_lock
from orchestrator.state.rundir import PlanMismatch, RunDir, config_hash, versions
from orchestrator.storage import location, object_append, storage
from orchestrator.surface import setting

log = logging.getLogger(__name__)

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
    files = list_files(cfg.corpus.path, warn=False)  # plan_locked lists them again, and warns
    if all(_is_empty(f) for f in files):
        raise NothingToRun(f"corpus.path {cfg.corpus.path!r} is empty ({len(files)} file(s) of 0 bytes); "
                           f"point {setting('corpus.path', 'FILE')} at a file with at least one prompt")
    limits = PackingLimits.resolve(cfg.packing, cfg.engine, cfg.sampling, kv_groups(cfg.model, cfg.engine))
    context = max_seq_len(cfg.model, cfg.engine)
    new = cfg.sampling.max_new_tokens
    if 1 + new > context:
        raise NothingToRun(f"no prompt can fit: sampling.max_new_tokens={new:,} plus a one-token prompt exceeds "
                           f"the model's context of {context:,} tokens (engine.max_seq_len, else the model's "
                           f"max_position_embeddings); lower sampling.max_new_tokens below {context:,}")
    if (why := limits.why_unfit(1)) is not None:
        raise NothingToRun(f"no prompt can fit: even a one-token prompt {why}; lower sampling.max_new_tokens or "
                           "sampling.n, or raise the budget")
    refuse_bad_prompt_settings(cfg)


def refuse_bad_prompt_settings(cfg: RunConfig) -> None:
    """Raise NothingToRun for settings of every prompt that cannot hold, found at the head before any slice (`run`,
    `plan`, `check`): a structured output that does not compile, chat template variables the template never reads."""
    refuse_bad_structured_output(cfg)
    if cfg.corpus.chat_template_kwargs and (why := unread_kwargs(load_tokenizer(cfg.model), cfg.model.tokenizer_path,
                                                                 cfg.corpus.chat_template_kwargs)):
        raise NothingToRun(why)


def refuse_bad_structured_output(cfg: RunConfig) -> None:
    """Raise NothingToRun when the run's structured output (sampling.json_schema / regex / choice / grammar) does
    not compile for the model's tokenizer: found at the head, before any slice (`run`, `plan`, `check`)."""
    if cfg.sampling.structured is None:
        return
    tokenizer = load_tokenizer(cfg.model)
    vocab_size = decoder_config(cfg.model).get("vocab_size") or len(tokenizer)
    if (why := structured_error(tokenizer, vocab_size, cfg.sampling)) is not None:
        raise NothingToRun(f"{why}; fix it (the run's structured output applies to every prompt)")


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
    with ManifestLines() as batches:  # the batches' records as manifest lines, window after window
        try:
            stats = _plan_into(cfg, run_dir, files, batches, prints["tokenizer"])
        except Exception as e:  # noqa: BLE001 - only a full disk is turned into its one line; the rest is re-raised
            full = disk_full(e, run_dir.root)
            if full is None:
                raise
            raise full from None
        if stats.accepted:
            _commit(cfg, run_dir, stats, prints, weights, files, batches)
    if stats.accepted == 0:  # rejected.jsonl stays for the user to read; no plan, so a fixed corpus replans
        shutil.rmtree(run_dir.batches, ignore_errors=True)
        with object_append.open_append(run_dir.events) as events:
            events.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S%z')} not planned: {_nothing_accepted(stats, run_dir, cfg)}\n")
        raise NothingToRun(_nothing_accepted(stats, run_dir, cfg))
    return PlanResult(run_dir.root, stats, False)


def _commit(cfg: RunConfig, run_dir: RunDir, stats: PlanStats, prints: dict, weights: dict, files: list[str],
            batches: ManifestLines) -> None:
    """Write run.json and then the manifest (of the `batches` planned): from then on the run directory is planned."""
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
    write_manifest(run_dir.manifest, [], held=batches)
    with object_append.open_append(run_dir.events) as events:
        events.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S%z')} planned {stats.num_batches} batches: "
                     f"{stats.accepted} prompts accepted, {stats.rows_read - stats.accepted} rejected\n")


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
        keys = ("text_field", "messages_field", "token_ids_field")
        fields = [f"corpus.{key}={getattr(cfg.corpus, key)!r}" for key in keys if getattr(cfg.corpus, key)]
        fix = (f"; no row has the field {' or '.join(fields)} names: set "
               f"{setting('corpus.text_field', 'FIELD')} to the corpus's own field")
    return (f"no prompt accepted: all {stats.rows_read:,} rows were rejected ({reasons}){fix}; each row's reason is "
            f"in {run_dir.rejected}")


def _plan_into(cfg: RunConfig, run_dir: RunDir, files: list[str], batches: ManifestLines,
               tokenizer_print: str) -> PlanStats:
    """Count the corpus's rows, then plan it a window of rows at a time (window_rows): tokenize the window,
    reject its bad rows (and ids an earlier row holds), pack it, write its batch files, add its batches' records to
    `batches`, and let it go. Batches are numbered across windows in corpus order; what is kept from one window to the
    next is bounded (PlanTally, SeenIds). `tokenizer_print`: the tokenizer files' digest (tokenizer_fingerprint)."""
    limits = PackingLimits.resolve(cfg.packing, cfg.engine, cfg.sampling, kv_groups(cfg.model, cfg.engine))
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
    stored = corpus_bytes(files)
    in_process = stored <= cfg.corpus.in_process_bytes
    shards, counts, workers = count(shards, cfg.cluster, in_process)
    num_rows = sum(rows for rows, _ in counts)
    phase(f"counting the {num_rows:,} rows of {len(shards)} shards")
    if num_rows == 0:  # e.g. only blank lines: nothing to tokenize
        return PlanTally().stats(limits)
    tokenizer_args = (cfg.model, cfg.corpus, limits, context, decoder_config(cfg.model).get("vocab_size"), cfg.sampling)
    id_bound = num_rows  # more than any batch index: names stay the same width whatever the windows pack to
    tally = PlanTally()
    window = window_rows(cfg.corpus, num_rows, stored)
    windows = range(0, num_rows, window)
    began = time.monotonic()
    if len(windows) > 1:  # a long plan: a line a window (the terminal and `ray job logs` both show stderr)
        print(f"plan: {num_rows:,} rows in {len(windows)} windows of {window:,} rows (corpus.window_rows, "
              "corpus.window_bytes)", file=sys.stderr, flush=True)
    with LineSpool() as rejected_lines, SeenIds(str(run_dir.batches), id_bound) as seen:
        for w, start in enumerate(windows):
            end = min(start + window, num_rows)
            where = f" (window {w + 1}/{len(windows)}: rows {start:,}-{end - 1:,})" if len(windows) > 1 else ""
            tokenized = tokenize(window_shards(shards, counts, start, end), tokenizer_args, tokenizer_print, workers)
            phase(f"tokenizing{where} " + (f"on {workers} CPUs of the cluster" if workers else "here"))
            for record in _plan_window(tokenized, start, end, limits, run_dir, files, seen, tally, rejected_lines,
                                       phase, where, len(batches)):
                hold(batches, record)
            tokenized.release()
            if len(windows) > 1:
                elapsed = time.monotonic() - began
                print(f"plan: window {w + 1}/{len(windows)} done: {end:,} rows, {len(batches):,} batches, "
                      f"{elapsed:,.0f} s (about {elapsed * (num_rows - end) / end:,.0f} s to go)",
                      file=sys.stderr, flush=True)
            crash_point("window_planned")
        os.sync()  # one durability barrier for every batch file, before the manifest refers to them
        rejected_lines.commit(run_dir.rejected)
    return tally.stats(limits)


def window_rows(corpus: CorpusConfig, num_rows: int, stored_bytes: int) -> int:
    """Rows a planning window holds: corpus.window_rows, fewer where corpus.window_bytes holds fewer rows at the
    corpus's average bytes per row (the same for every window, so a window's rows follow from the counts alone)."""
    return max(1, min(corpus.window_rows, corpus.window_bytes * num_rows // max(1, stored_bytes)))


def _plan_window(tokenized: InProcess | OnRay, start: int, end: int, limits: PackingLimits, run_dir: RunDir,
                 files: list[str], seen: SeenIds, tally: PlanTally, rejected_lines: LineSpool, phase,
                 where: str, first_batch: int) -> list[BatchRecord]:
    """Plan rows [start, end) into batches first_batch, first_batch + 1, ...: their records."""
    summary = _summaries(tokenized.summaries(), start, end)
    summary = _reject_duplicates(summary, seen)
    accepted = summary.filter(pc.is_null(summary["reason"]))
    rejected = summary.filter(pc.is_valid(summary["reason"]))
    rejected_lines.write(_rejected_lines(rejected, files))
    lengths = accepted["num_tokens"].to_numpy().astype(np.int64)
    new_tokens = accepted["max_new_tokens"].to_numpy().astype(np.int64)
    if (new_tokens == limits.max_new_tokens).all():  # no row sets its own: the run's, as packing defaults to
        new_tokens = None
    continuations = accepted["num_continuations"].to_numpy().astype(np.int64)
    prefill = accepted["prefill_tokens"].to_numpy().astype(np.int64)
    if not continuations.any():  # no scored row: every prompt is measured by its length and max_new_tokens alone
        continuations = prefill = None
    first_keys, all_keys = _page_keys(accepted)
    phase(f"collecting summaries and rejections{where}")
    packing = pack(lengths, limits, first_keys, new_tokens, continuations, prefill)
    num_batches = packing.num_batches

    rows = accepted["row"].to_numpy() - start
    batch_of_row = np.full(end - start, -1, dtype=np.int32)  # the window's rows are start..end-1 in order
    position_of_row = np.zeros(end - start, dtype=np.int32)
    batch_of_item = first_batch + packing.batch_of_item()
    batch_of_row[rows] = batch_of_item
    position_of_row[rows[packing.order]] = np.arange(len(packing.order), dtype=np.int32)
    seen.add(accepted["prompt_id"], batch_of_item)
    phase(f"packing into {num_batches} batches{where}")
    if num_batches:
        assignment = Assignment(start, batch_of_row, position_of_row, seen.id_bound)
        written = tokenized.write_batches(assignment, str(run_dir.batches), (first_batch, first_batch + num_batches),
                                          int(lengths.sum()))
        if written != num_batches:
            raise RuntimeError(f"internal error: wrote {written} batch files for {num_batches} batches")
    phase(f"writing {num_batches} batch files{where}")
    tally.add(end - start, rejected["reason"].to_pylist(), lengths, packing,
              bound_totals(lengths, limits, new_tokens, continuations, prefill),
              shareable_prompt_tokens(all_keys, limits.page_size))
    return [
        BatchRecord(batch_id(first_batch + b, seen.id_bound),
                    num_prompts=int(packing.offsets[b + 1] - packing.offsets[b]),
                    num_prompt_tokens=int(packing.num_prompt_tokens[b]), num_pages=int(packing.num_pages[b]),
                    expected_samples=None if continuations is None else batch_samples(continuations[packing.batch(b)]))
        for b in range(num_batches)
    ]


def _page_keys(accepted: pa.Table) -> tuple[np.ndarray, np.ndarray]:
    """(u64[prompts]: each accepted prompt's first leading-page key, 0 for none; u64[pages]: all their keys)."""
    keys = accepted["page_keys"]
    counts = pc.list_value_length(keys).to_numpy(zero_copy_only=False).astype(np.int64)
    flat = np.asarray(pc.list_flatten(keys).to_numpy(zero_copy_only=False), dtype=np.uint64)
    first = np.zeros(len(counts), dtype=np.uint64)
    has = counts > 0
    first[has] = flat[(np.cumsum(counts) - counts)[has]]
    return first, flat


def _summaries(parts: list[pa.Table], start: int, end: int) -> pa.Table:
    table = pa.concat_tables(parts) if parts else pa.table({c: [] for c in SUMMARY_COLUMNS})
    if not np.all(np.diff(table["row"].to_numpy()) > 0):  # blocks often come in order: then no copy of the window
        table = table.sort_by("row")
    if not np.array_equal(table["row"].to_numpy(), np.arange(start, end)):
        raise RuntimeError("internal error: corpus rows were lost or duplicated while tokenizing")
    return table


def _reject_duplicates(summary: pa.Table, seen: SeenIds) -> pa.Table:
    """A prompt id seen before (in corpus order: earlier in this window, or accepted in an earlier one) rejects the
    later row: ids must be unique."""
    ok = pc.is_null(summary["reason"])
    ids = summary["prompt_id"].combine_chunks()
    first = pa.table({"id": ids, "row": summary["row"]}).filter(ok).group_by("id", use_threads=False).aggregate([("row", "min")])
    accepted_ids = ids.filter(ok)
    earlier = seen.earlier_rows(accepted_ids)
    if first.num_rows == int(pc.sum(ok.cast(pa.int64())).as_py() or 0) and not earlier:
        return summary
    first_row = dict(zip(first["id"].to_pylist(), first["row_min"].to_pylist()))
    first_row.update({accepted_ids[i].as_py(): row for i, row in earlier.items()})  # an earlier window comes first
    reasons, details = summary["reason"].to_pylist(), summary["detail"].to_pylist()
    rows = summary["row"].to_pylist()
    for i, (pid, reason) in enumerate(zip(ids.to_pylist(), reasons)):
        if reason is None and first_row[pid] != rows[i]:
            reasons[i], details[i] = "duplicate_id", f"prompt id {pid!r} already used by row {first_row[pid]}"
    return summary.set_column(summary.schema.get_field_index("reason"), "reason", pa.array(reasons, pa.string())) \
        .set_column(summary.schema.get_field_index("detail"), "detail", pa.array(details, pa.string()))


def _rejected_lines(rejected: pa.Table, files: list[str]) -> list[str]:
    """rejected.jsonl's lines for a window's rejected rows."""
    return [dumps({"row": r["row"], "prompt_id": r["prompt_id"], "reason": r["reason"], "detail": r["detail"],
                   "file": files[r["file_index"]], "line": r["line"], "num_tokens": r["num_tokens"] or None})
            for r in rejected.to_pylist()]


def check_same_plan(run_dir: RunDir, cfg: RunConfig, fingerprints: dict[str, str]) -> None:
    """Refuse to reuse a planned run directory for different samples (capacities may differ: see retune)."""
    old = run_dir.read_run_json()
    problems = plan_changes(old["sample_affecting"], cfg)
    for name in ("corpus", "tokenizer", "model"):
        if old["fingerprints"].get(name) != fingerprints.get(name):
            problems.append(f"the {name} changed since planning ({name} fingerprint differs)")
    if problems:
        raise PlanMismatch(
            f"run directory {run_dir.root} was planned for different samples:\n  " + "\n  ".join(problems)
            + "\nTo continue that run, use its original config and inputs. To start a new run, pass a new "
            f"{setting('name', 'NAME')} (or {setting('run_dir', 'DIR')})."
        )
