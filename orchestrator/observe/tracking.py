"""Experiment tracking (W&B or nothing); only the head talks to the tracker.

Slices never log: they return their stats as data with their results, and the head turns each
finished batch into one row here (deferred emission by construction). A tracker therefore belongs
to the process that made it; using it from another process, or pickling it to send it to a Ray
actor, is refused with an error that says so. `wandb` is imported only when a W&B tracker is made,
so importing this module stays cheap and `type: noop` needs no W&B at all.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NoReturn, Protocol

from engine import RECORD_FIELDS
from orchestrator.storage import storage

# W&B truncates a logged wandb.Table to this many rows (wandb.Table.MAX_ROWS), with only a warning.
WANDB_TABLE_MAX_ROWS = 10_000
# The samples table: the sample record's scalar fields (engine.SampleRecord), which sample first, the token
# lists summed up as a count; the input's passed-through columns (a prompt may be long) are left to the export.
_KEY_COLUMNS = ("prompt_id", "generation_index", "batch_id")
_LEFT_OUT = (*_KEY_COLUMNS, "token_ids", "logprobs", "passthrough", "prompt_logprobs", "continuation_logprobs")
# A scored row's sample keeps its scalars (continuation_logprob, is_greedy; null for a sampled row).
SAMPLE_COLUMNS = (*_KEY_COLUMNS, *(f for f in RECORD_FIELDS if f not in _LEFT_OUT),
                  "num_output_tokens")

BatchRow = dict[str, int | float | str | None]


@dataclass(frozen=True)
class TrackerConfig:
    type: Literal["wandb", "noop"] = "wandb"
    """`wandb` logs to Weights & Biases; `noop` logs nothing."""
    project: str = "pagefleet"
    """W&B project."""
    mode: Literal["online", "offline", "disabled"] = "offline"
    """W&B mode: `offline` writes run files under RUN_DIR/wandb/ and opens no connection (upload them
    later with `wandb sync RUN_DIR/wandb/offline-run-*`); `disabled` writes nothing."""
    entity: str | None = None
    """W&B entity (user or team); null uses the logged-in default."""
    group: str | None = None
    """W&B group; null groups by the run name, so the runs of one resumed job sit together."""
    samples_table_rows: int = 200
    """At most this many sample rows go to the `samples` table (the first ones to finish); 0 logs
    no samples. The table is logged as soon as it is full, so it shows early in a long run and
    survives a crash of the head; else at the end. Samples themselves live in RUN_DIR/outputs/; the
    table is a window onto them."""
    batches_table_rows: int = WANDB_TABLE_MAX_ROWS
    """At most this many rows go to the `batches` table (the first batches to finish); every batch
    is still logged as a history row, so the charts cover the whole run."""

    def __post_init__(self) -> None:
        if self.type not in ("wandb", "noop"):
            raise ValueError(f"tracker.type must be 'wandb' or 'noop', got {self.type!r}")
        if self.mode not in ("online", "offline", "disabled"):
            raise ValueError(f"tracker.mode must be 'online', 'offline' or 'disabled', got {self.mode!r}")
        for name in ("samples_table_rows", "batches_table_rows"):
            value = getattr(self, name)
            if not 0 <= value <= WANDB_TABLE_MAX_ROWS:
                raise ValueError(
                    f"tracker.{name} must be between 0 and {WANDB_TABLE_MAX_ROWS:,} (W&B truncates larger "
                    f"tables), got {value}"
                )


class Tracker(Protocol):
    """What the head calls; every call happens in the head process."""

    def log_batch(self, row: BatchRow) -> None:
        """One row per finished batch (batch_id, num_prompts, num_output_tokens, tokens_per_s, ...)."""
        ...

    def add_samples(self, records: list[dict[str, Any]]) -> None:
        """Sample records (docs/records.md); only the first `samples_table_rows` overall are kept."""
        ...

    def finish(self, summary: dict[str, float | int | str]) -> None:
        """Final figures (throughput, totals); writes the tables and closes the run."""
        ...


class HeadOnly:
    """Refuses use from any process but the one that made it, and refuses pickling."""

    def __init__(self) -> None:
        self._owner_pid = os.getpid()

    def _check_owner(self) -> None:
        if os.getpid() != self._owner_pid:
            raise RuntimeError(
                f"this {type(self).__name__} was made in process {self._owner_pid} and is used in process "
                f"{os.getpid()}: the tracker belongs to the head process; slices return stats as data and "
                "the head logs them"
            )

    def __reduce__(self) -> NoReturn:
        raise TypeError(
            f"cannot pickle a {type(self).__name__}: the tracker belongs to the head process; slices return "
            "stats as data"
        )


class NoopTracker(HeadOnly):
    """Logs nothing (tracker.type: noop, or tracker.mode: disabled)."""

    def log_batch(self, row: BatchRow) -> None:
        self._check_owner()

    def add_samples(self, records: list[dict[str, Any]]) -> None:
        self._check_owner()

    def finish(self, summary: dict[str, float | int | str]) -> None:
        self._check_owner()


def sample_row(record: dict[str, Any]) -> list[Any]:
    """A sample record as a `samples` table row (SAMPLE_COLUMNS); output tokens counted if absent."""
    num_output_tokens = record.get("num_output_tokens")
    if num_output_tokens is None:
        num_output_tokens = len(record.get("token_ids") or ())
    values = {**record, "prompt_id": str(record["prompt_id"]), "num_output_tokens": num_output_tokens}
    return [values.get(column) for column in SAMPLE_COLUMNS]


class WandbTracker(HeadOnly):
    """One W&B run per job: config at init, a history row per batch, two bounded tables: `samples` as soon
    as it is full (else at finish), `batches` at finish.

    Offline run files land under `run_dir/wandb/offline-run-<time>-<id>/` (the run's config, history
    and summary in `run-<id>.wandb`, the tables in `files/media/table/*.table.json`).
    """

    def __init__(self, config: TrackerConfig, run_dir: Path, run_name: str, run_config: dict[str, Any]) -> None:
        super().__init__()
        import wandb  # only the head, and only with type: wandb, pays for importing W&B

        self._config = config
        self._batch_rows: list[BatchRow] = []
        self._batch_keys: set[str] = set()  # every key a batch row logged: W&B copies each into the summary
        self._sample_rows: list[list[Any]] = []
        self._samples_logged = False
        self._finished = False
        disabled = config.mode == "disabled"
        if not disabled and not storage.is_url(run_dir):
            Path(run_dir).mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(
            project=config.project,
            entity=config.entity,
            group=config.group or run_name,
            name=run_name,
            job_type="sample",
            # W&B makes `dir` even when disabled; it writes local files, so a gs:// run keeps them in the working directory.
            dir=None if disabled or storage.is_url(run_dir) else str(run_dir),
            mode=config.mode,
            config=run_config,
            # Own run object (never the global wandb.run); no console capture or system metrics: the
            # head's console is a progress bar and its machine is not where the work happens.
            settings=wandb.Settings(reinit="create_new", console="off", x_disable_stats=True),
        )

    def log_batch(self, row: BatchRow) -> None:
        self._check_owner()
        self._run.log(dict(row))
        self._batch_keys.update(row)
        if len(self._batch_rows) < self._config.batches_table_rows:
            self._batch_rows.append(dict(row))

    def add_samples(self, records: list[dict[str, Any]]) -> None:
        self._check_owner()
        room = self._config.samples_table_rows - len(self._sample_rows)
        self._sample_rows.extend(sample_row(r) for r in records[: max(room, 0)])
        if room > 0 and len(self._sample_rows) == self._config.samples_table_rows:
            self._log_samples()  # full: show it now, not days later at the end of a long run (or never, on a crash)

    def _log_samples(self) -> None:
        import wandb

        if not self._samples_logged:
            self._run.log({"samples": wandb.Table(columns=list(SAMPLE_COLUMNS), data=self._sample_rows,
                                                  allow_mixed_types=True)})
            self._samples_logged = True

    def finish(self, summary: dict[str, float | int | str]) -> None:
        self._check_owner()
        if self._finished:
            raise RuntimeError("this tracker has already finished; make a new one for a new run")
        import wandb

        columns: list[str] = []
        for row in self._batch_rows:  # union of keys in order of first appearance
            columns.extend(k for k in row if k not in columns)
        # Mixed types allowed: a column that holds an int in one row and a string in another must not
        # make the end of a multi-day run raise.
        data = [[row.get(k) for k in columns] for row in self._batch_rows]
        self._run.log({"batches": wandb.Table(columns=columns, data=data, allow_mixed_types=True)})
        if self._config.samples_table_rows:
            self._log_samples()  # fewer samples than the table holds (or it was logged when it filled)
        # W&B's summary holds each history key's last value: the last batch's batch_id, duration_s, ... read as
        # if they described the run. The run's summary is the run's totals only.
        for key in sorted(self._batch_keys - set(summary)):
            try:
                del self._run.summary[key]
            except KeyError:
                pass
        self._run.summary.update(dict(summary))
        self._run.finish()
        self._finished = True


def make_tracker(config: TrackerConfig, run_dir: Path, run_name: str, run_config: dict[str, Any]) -> Tracker:
    """The head's tracker: W&B unless `type: noop` or `mode: disabled` (then nothing is written)."""
    if config.type == "noop" or config.mode == "disabled":
        return NoopTracker()
    return WandbTracker(config, run_dir, run_name, run_config)
