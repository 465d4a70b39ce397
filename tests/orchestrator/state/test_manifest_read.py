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
