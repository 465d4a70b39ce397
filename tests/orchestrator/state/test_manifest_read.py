"""batches.jsonl is read many lines at a time; a corrupt line is still named by its number."""

from __future__ import annotations

import json

import pytest

from orchestrator.state import manifest
from orchestrator.state.manifest import BatchRecord, CorruptRunFile, read_manifest, write_manifest


@pytest.mark.parametrize("damage, line", [
    (lambda lines: lines.__setitem__(5000, lines[5000][:-10]), 5001),  # cut short, in the second chunk
    (lambda lines: lines.__setitem__(7, lines[7] + ", {}"), 8),  # two values on one line
    (lambda lines: lines.__setitem__(9000, json.dumps({"batch_id": "x", "bogus": 1})), 9001),  # not a record
], ids=["truncated", "two-values", "unknown-field"])
def test_a_corrupt_line_is_named_however_many_lines_are_read_at_once(tmp_path, damage, line):
    path = tmp_path / "batches.jsonl"
    records = [BatchRecord(f"b{i:05d}", num_prompts=1) for i in range(10_000)]
    write_manifest(path, records)
    assert read_manifest(path) == records and manifest._CHUNK_LINES < len(records)
    lines = path.read_text().splitlines()
    damage(lines)
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(CorruptRunFile, match=f"line {line} is corrupt"):
        read_manifest(path)


def test_a_big_manifest_is_written_a_chunk_at_a_time_with_the_digest_of_what_was_written(tmp_path):
    """A million batches' manifest is ~300 MB of JSON: written whole it was held twice (text and bytes) beside the
    records, a 1.4 GiB peak on the head. Streamed, the writer holds one chunk of lines."""
    import hashlib
    import tracemalloc

    path = tmp_path / "batches.jsonl"
    records = [BatchRecord(f"b{i:06d}", "done", num_prompts=64, num_prompt_tokens=3000, num_pages=300,
                           output=f"outputs/b{i:06d}.parquet", num_samples=64, output_bytes=123456)
               for i in range(60_000)]
    tracemalloc.start()
    write_manifest(path, records)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    size = path.stat().st_size
    assert size > 10 * 2**20 and peak < size / 4, f"writing {size:,} bytes peaked at {peak:,} bytes"
    assert read_manifest(path) == records
    _, _, as_written = manifest.read_manifest_as_written(path)
    assert as_written  # its digest is the one of the bytes on disk
    assert (tmp_path / "batches.jsonl.sha256").read_text() == hashlib.sha256(path.read_bytes()).hexdigest()
