"""The manifest, `batches.jsonl`: one record per batch, the resume point; the head is its only writer."""

from __future__ import annotations

import hashlib
import io
import json
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import BinaryIO, Literal, NamedTuple

from orchestrator.json_out import dumps
from orchestrator.state.manifest_lines import ManifestLines
from orchestrator.state.lock import RunDirLocked
from orchestrator.storage import generations, storage
from orchestrator.storage.atomic import atomic_write

Status = Literal["pending", "running", "done", "failed"]
STATUSES: tuple[Status, ...] = ("pending", "running", "done", "failed")


@dataclass(frozen=True)
class BatchRecord:
    batch_id: str
    status: Status = "pending"
    num_prompts: int = 0
    num_prompt_tokens: int = 0
    num_pages: int = 0
    """KV pages reserved for the batch (worst case, every sample at full length)."""
    attempts: int = 0
    error: str | None = None
    slice: str | None = None
    """Who ran it last."""
    started_at: float | None = None
    finished_at: float | None = None
    output: str | None = None
    """outputs/<id>.parquet relative to the run directory, once done."""
    num_samples: int = 0
    """Samples written (num_prompts * sampling.n once done)."""
    num_output_tokens: int = 0
    """Completion tokens over the batch's samples."""
    duration_s: float | None = None
    """Time in the slice's engine, first request in to last sample out."""
    occupancy: float | None = None
    """Mean live sequences per engine step while the batch ran, as a fraction of engine.max_seqs."""
    output_bytes: int | None = None
    """The size of the output as the head wrote it (None in records older than the field): a resume checks each
    done batch's output against it from one listing of outputs/, instead of reading a million footers."""
    expected_samples: int | None = None
    """The samples the batch gives once done where that is not num_prompts * sampling.n: a batch with scored rows
    (one sample per continuation, continuation.batch_samples). None otherwise, and then not written to the manifest
    (older manifests have no such field)."""

    def samples(self, n: int) -> int:
        """The samples the batch gives once done, with `n` samples per sampled prompt."""
        return self.num_prompts * n if self.expected_samples is None else self.expected_samples


FIELDS = tuple(f.name for f in fields(BatchRecord))


def record_line(r: BatchRecord) -> str:
    """The record's manifest line, newline included."""
    return dumps({name: getattr(r, name) for name in FIELDS
                  if name != "expected_samples" or r.expected_samples is not None}) + "\n"


def hold(lines: ManifestLines, r: BatchRecord) -> None:
    """Hold the record in `lines` as its manifest line (it is not a record any more)."""
    lines.add(record_line(r).encode(), r.status, r.num_prompts, r.num_samples, r.num_output_tokens)


class PendingLine(NamedTuple):
    """A batch never tried, as its manifest line (read_for_resume): what a resumed head holds of most of the batches
    still to do until it takes them (RunState builds the record then). It answers the fields that pending and
    untried determine, and its num_prompts; the rest are in `line`."""

    batch_id: str
    num_prompts: int
    line: bytes
    status: Status = "pending"
    attempts: int = 0
    slice: None = None
    output: None = None

    def record(self) -> BatchRecord:
        return BatchRecord(**json.loads(self.line))


def _lines(records: list[BatchRecord | PendingLine]) -> bytes:
    return b"".join(r.line if type(r) is PendingLine else record_line(r).encode() for r in records)


def digest_path(path: str | Path) -> str:
    """Where the head keeps the sha256 of the manifest it last wrote: batches.jsonl.sha256 beside it."""
    return f"{path}.sha256"


def batch_id(index: int, num_batches: int) -> str:
    """Zero-padded so ids sort in batch order: b000000, b000001, ..."""
    return f"b{index:0{max(6, len(str(max(num_batches - 1, 0))))}d}"


class ManifestConflict(RunDirLocked):
    """Another head replaced batches.jsonl on the object store since this head last wrote it: this head lost the
    run directory (`pagefleet run` stops with the message, exit status 2)."""


def write_manifest(path: str | Path, records: list[BatchRecord], before_replace=None,
                   generation: int | None = None, held: ManifestLines | None = None) -> int | None:
    """Replace the manifest atomically with `held`'s lines (batches held as lines, not records) and then
    `records`'; on an object store, returns the generation written.

    Locally a temporary file and a rename (the `flock` keeps other heads out). On an object store one
    whole-object write conditioned on `generation`, the one this head last read or wrote (None: the
    manifest must not exist yet, as when planning): a second head that wrote in between (this one
    stalled and lost its lock) makes this raise ManifestConflict instead of being overwritten.
    """
    # The digest goes after the manifest: a crash in between leaves a digest that does not match, and the next resume
    # checks the manifest line by line, as it checks one somebody edited.
    if not storage.is_object_store(path):  # streamed to the temporary file: a million records are not held twice
        digest = held.sha256() if held is not None else hashlib.sha256()

        def write(tmp: str) -> None:
            with open(tmp, "wb") as f:
                if held is not None:
                    held.copy_to(f)
                for start in range(0, len(records), _CHUNK_LINES):
                    chunk = _lines(records[start:start + _CHUNK_LINES])
                    digest.update(chunk)
                    f.write(chunk)

        atomic_write(path, write, before_replace=before_replace)
        storage.write_atomic(digest_path(path), digest.hexdigest().encode())
        _write_totals(path, manifest_totals(records, held), {"sha256": digest.hexdigest()})
        return None
    data = (held.data() if held is not None else b"") + _lines(records)
    if before_replace is not None:
        before_replace()
    try:
        if generation is None:
            written = generations.create_if_absent(str(path), data)
        else:
            written = generations.replace_if_generation(str(path), data, generation)
    except generations.PreconditionFailed:
        expected = "absent" if generation is None else f"at generation {generation}"
        raise ManifestConflict(f"{path} was written by another head (this head expected it {expected}); stopping "
                               "without overwriting it: the other head owns the run now") from None
    storage.write_atomic(digest_path(path), hashlib.sha256(data).hexdigest().encode())
    _write_totals(path, manifest_totals(records, held), {"generation": written})
    return written


def manifest_totals(records: Iterable[BatchRecord], held: ManifestLines | None = None) -> dict:
    """What `status` and the run summary read from a manifest (`records`, and the batches `held` as lines):
    batches per status, prompts (all, and done), samples and output tokens of the done batches, and each failed
    batch as [batch_id, attempts, error]."""
    counts: Counter[str] = Counter()
    prompts = prompts_done = samples_done = output_tokens = 0
    if held is not None:
        counts.update(held.counts)
        prompts, prompts_done, samples_done, output_tokens = (held.prompts, held.prompts_done, held.samples_done,
                                                              held.output_tokens)
    failed = []
    for r in records:
        counts[r.status] += 1
        prompts += r.num_prompts
        if r.status == "done":
            prompts_done += r.num_prompts
            samples_done += r.num_samples
            output_tokens += r.num_output_tokens
        elif r.status == "failed":
            failed.append([r.batch_id, r.attempts, r.error])
    return {"counts": {s: counts.get(s, 0) for s in STATUSES}, "prompts": prompts, "prompts_done": prompts_done,
            "samples_done": samples_done, "output_tokens": output_tokens, "failed": failed}


def totals_path(path: str | Path) -> str:
    """batches.totals.json beside the manifest: its `manifest_totals`, written by the head right after the manifest,
    with the manifest's identity (its sha256 locally, where an edit in place can keep the size and, within a clock
    tick, the mtime; its generation on an object store, which every write changes)."""
    return str(path).removesuffix(".jsonl") + ".totals.json"


def read_totals(path: str | Path) -> dict | None:
    """The manifest's totals as the head wrote them beside it, or None when the manifest is no longer the one they
    were computed from (replaced or edited since, or a crash between the two writes) or they are missing: then
    read the manifest itself. `status` reads these instead of every line of a manifest of a million batches."""
    try:
        saved = json.loads(storage.read_text(totals_path(path)))
    except (FileNotFoundError, ValueError):
        return None
    identity = _identity(path)
    if not isinstance(saved, dict) or identity is None or saved.get("manifest") != identity:
        return None
    return saved.get("totals")


def _identity(path: str | Path) -> dict | None:
    """Which manifest this is: any write or edit changes it. Locally its sha256, read a MiB at a time (a manifest of
    a million batches hashes in well under a second; parsing it takes seconds)."""
    if storage.is_object_store(path):
        info = generations.object_info(str(path))
        return None if info is None else {"generation": info["generation"]}
    try:
        with open(path, "rb") as f:
            return {"sha256": _sha256(f)}
    except FileNotFoundError:
        return None


def _write_totals(path: str | Path, totals: dict, identity: dict | None) -> None:
    storage.write_atomic(totals_path(path), dumps({"manifest": identity, "totals": totals}).encode())


_CHUNK_LINES = 4096


def _parse(path: str | Path, lines: list[tuple[int, bytes]], kind=None,
           done: ManifestLines | None = None) -> list[BatchRecord | PendingLine]:
    """The records of some numbered lines, parsed as one JSON array (one C loop), or, when that fails or does not give
    one value a line, line by line to name the line that is corrupt. With `done` given, a line that `kind(fields)`
    calls "done" goes to `done` and one it calls "line" is a PendingLine (read_for_resume)."""
    try:
        values = json.loads(b"[" + b",".join(line for _, line in lines) + b"]")
        if len(values) != len(lines):
            raise ValueError("not one value a line")
    except (ValueError, RecursionError):
        values = [_value(path, line_no, line) for line_no, line in lines]
    records = []
    for (line_no, line), v in zip(lines, values):
        if done is not None and type(v) is dict and (held := kind(v)) is not None:
            if held == "done":
                done.add(line, "done", v["num_prompts"], v["num_samples"], v["num_output_tokens"])
            else:
                records.append(PendingLine(v["batch_id"], v["num_prompts"], line))
            continue
        try:
            records.append(BatchRecord(**v))
        except TypeError as e:  # not an object, or not a record's fields
            raise CorruptRunFile(f"{path} line {line_no} is corrupt ({type(e).__name__}: {e}); {RECOVER}") from None
    return records


def _value(path: str | Path, line_no: int, line: bytes):
    try:
        return json.loads(line)
    except (ValueError, RecursionError) as e:  # cut short, or not JSON
        raise CorruptRunFile(f"{path} line {line_no} is corrupt ({type(e).__name__}: {e}); {RECOVER}") from None


class CorruptRunFile(ValueError):
    """batches.jsonl or run.json cannot be read; the message names the file, the line and the recovery."""


RECOVER = ("remove it and rerun `pagefleet run` with the same config: the plan is rebuilt and the outputs "
           "already written are adopted")


def read_manifest(path: str | Path) -> list[BatchRecord]:
    """The records; raises CorruptRunFile naming the file and line of a record that does not parse."""
    return read_manifest_generation(path)[0]


def read_manifest_generation(path: str | Path) -> tuple[list[BatchRecord], int | None]:
    """The records and, on an object store, the generation they were read from (None locally)."""
    records, generation, _ = read_manifest_as_written(path)
    return records, generation


def read_manifest_as_written(path: str | Path) -> tuple[list[BatchRecord], int | None, bool]:
    """The records, the generation (object stores), and whether the manifest is byte for byte the one the head last
    wrote (its digest matches batches.jsonl.sha256): then nobody edited it since, and what the head checked when it
    wrote it holds."""
    records, _, generation, as_written = read_for_resume(path)
    return records, generation, as_written  # type: ignore[return-value]  (no PendingLine without `kind`)


def read_for_resume(path: str | Path, kind=None
                    ) -> tuple[list[BatchRecord | PendingLine], ManifestLines | None, int | None, bool]:
    """(records, done, generation, as_written) as read_manifest_as_written reads them; where the manifest is as the
    head wrote it and `kind` is given, no line is built as a record that `kind(fields)` settles (RunState.recover):
    "done" (a done batch, its output checked) goes to `done` as its line, "line" (a pending batch never tried) is a
    PendingLine (else `done` is None and every line a record)."""
    generation = None
    if storage.is_object_store(path):
        found = generations.read_with_generation(str(path))  # bytes and generation in one request: they agree
        if found is None:
            raise FileNotFoundError(f"{path} does not exist")
        data, generation = found
        f = io.BytesIO(data)
    else:
        f = open(path, "rb")  # streamed: a manifest of a million batches is not held twice
    try:
        recorded = storage.read_text(digest_path(path)).strip()
    except FileNotFoundError:
        recorded = None
    records: list[BatchRecord] = []
    done = None
    with f:
        if kind is not None and recorded == _sha256(f):  # one pass first (fast): is every line the head's?
            done = ManifestLines()
        digest = hashlib.sha256()
        chunk: list[tuple[int, bytes]] = []
        for line_no, line in enumerate(f, 1):
            if done is None:
                digest.update(line)
            if line.strip():
                chunk.append((line_no, line))
            if len(chunk) == _CHUNK_LINES:
                records += _parse(path, chunk, kind, done)
                chunk = []
        records += _parse(path, chunk, kind, done)
    return records, done, generation, done is not None or recorded == digest.hexdigest()


def _sha256(f: BinaryIO) -> str:
    """The sha256 of the rest of `f`, read a MiB at a time; `f` is back where it was."""
    at, digest = f.tell(), hashlib.sha256()
    while block := f.read(1 << 20):
        digest.update(block)
    f.seek(at)
    return digest.hexdigest()
