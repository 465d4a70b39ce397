"""`pagefleet export` keeps corpus order within a memory budget: a run too big for the budget is sorted
in runs on disk and merged, and must give exactly what one in-memory sort gives."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from engine import output_record
from orchestrator.commands import cli
from orchestrator.export.export import RECORD_FIELDS, done_outputs, export, page
from orchestrator.state.manifest import BatchRecord, batch_id, write_manifest
from orchestrator.state.results import SAMPLE_SCHEMA


def make_run(root: Path, num_rows: int = 240, n: int = 3, num_batches: int = 14, seed: int = 0,
             passthrough=lambda r: None, prompt_id=lambda r: f"doc-{r}") -> list[dict]:
    """A run directory whose done batches hold shuffled corpus rows (as longest-first packing leaves them),
    each batch in batch order then generation index; returns every sample, as exported, sorted the slow,
    obvious way. `passthrough(row)` gives a row's SampleRecord.passthrough."""
    rng = random.Random(seed)
    rows = list(range(num_rows))
    rng.shuffle(rows)
    cuts = sorted(rng.sample(range(1, num_rows), num_batches - 1))
    (root / "outputs").mkdir(parents=True)
    records, samples = [], []
    for i, (a, b) in enumerate(zip([0, *cuts], [*cuts, num_rows])):
        bid = batch_id(i, num_batches)
        batch = []
        for r in rows[a:b]:
            for g in range(n):
                tokens = [rng.randrange(50_000) for _ in range(rng.randint(0, 60))]
                batch.append({"prompt_id": prompt_id(r), "generation_index": g,
                              "completion": "".join(rng.choice("ab é\n\"") for _ in range(rng.randint(0, 300))),
                              "token_ids": tokens, "logprobs": [-rng.random() for _ in tokens] if g % 2 else None,
                              "finish_reason": rng.choice(["stop", "length"]), "num_prompt_tokens": rng.randint(1, 99),
                              "batch_id": bid, "row": r, "passthrough": passthrough(r)})
        pq.write_table(pa.Table.from_pylist(batch, schema=SAMPLE_SCHEMA), root / "outputs" / f"{bid}.parquet")
        records.append(BatchRecord(bid, status="done", output=f"outputs/{bid}.parquet", num_samples=len(batch)))
        samples += batch
    write_manifest(root / "batches.jsonl", records)
    return [output_record({k: s.get(k) for k in RECORD_FIELDS})  # fields the helper does not write are null
            for s in sorted(samples, key=lambda s: (s["row"], s["generation_index"]))]


def read_output(path: Path) -> list[dict]:
    if path.suffix == ".parquet":
        return pq.read_table(path).to_pylist()
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def approx(records: list[dict]) -> list[dict]:
    """float32 logprobs compared as float32 (JSON writes the float32 value's double form)."""
    out = []
    for r in records:
        lp = r["logprobs"]
        out.append({**r, "logprobs": None if lp is None else pa.array(lp, pa.float32()).to_pylist()})
    return out


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_export_sorted_on_disk_equals_the_in_memory_sort(tmp_path, suffix):
    expected = make_run(tmp_path / "run")
    small, big = tmp_path / "out" / f"small{suffix}", tmp_path / "out" / f"big{suffix}"
    messages = []
    # 720 samples, ~0.6 KB each in memory: a 100 KB budget sorts runs of ~33 KB (a batch or two each).
    assert export(tmp_path / "run", small, memory_bytes=100_000, log=messages.append) == len(expected)
    runs = [m for m in messages if m.startswith("merging")]
    assert runs and int(runs[0].split()[1]) >= 5, messages
    assert export(tmp_path / "run", big) == len(expected)  # default budget: one sort in memory
    assert approx(read_output(small)) == approx(expected)
    assert read_output(small) == read_output(big)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted([small.name, big.name])  # no runs left


def test_page_crosses_merge_rounds(tmp_path):
    expected = approx(make_run(tmp_path / "run", seed=1))
    done = done_outputs(tmp_path / "run")
    for offset, limit in [(0, 5), (37, 200), (len(expected) - 3, 10), (len(expected), 4), (11, 0)]:
        total, rows = page(done, tmp_path, offset, limit, memory_bytes=60_000)
        assert total == len(expected)
        assert approx(rows) == expected[offset:offset + limit], (offset, limit)
    assert [p.name for p in tmp_path.iterdir()] == ["run"]  # a page that stopped early removed its runs too


def test_export_partial_only_done_batches_and_unfinished_refused(tmp_path):
    expected = make_run(tmp_path / "run", seed=2)
    manifest = tmp_path / "run" / "batches.jsonl"
    records = [BatchRecord(**json.loads(line)) for line in manifest.read_text().splitlines()]
    pending = {records[3].batch_id, records[7].batch_id}
    write_manifest(manifest, [BatchRecord(r.batch_id) if r.batch_id in pending else r for r in records])
    with pytest.raises(ValueError, match=r"2 of 14 batches are not done .*--partial"):
        export(tmp_path / "run", tmp_path / "out.jsonl")
    assert not (tmp_path / "out.jsonl").exists()
    count = export(tmp_path / "run", tmp_path / "out.jsonl", partial=True, memory_bytes=80_000)
    want = [r for r in approx(expected) if r["batch_id"] not in pending]
    assert count == len(want) and approx(read_output(tmp_path / "out.jsonl")) == want


def test_export_names_a_done_batch_without_its_samples_file(tmp_path, capsys):
    make_run(tmp_path / "run", seed=3)
    lost = batch_id(5, 14)
    (tmp_path / "run" / "outputs" / f"{lost}.parquet").unlink()
    out = tmp_path / "out" / "all.jsonl"
    assert cli.main(["export", str(tmp_path / "run"), "--output", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"batch {lost} is done" in err and "missing" in err
    assert not out.exists()


def test_export_command_with_a_small_budget(tmp_path, capsys):
    expected = make_run(tmp_path / "run", seed=4)
    out = tmp_path / "all.parquet"
    assert cli.main(["export", str(tmp_path / "run"), "--output", str(out), "--memory-gb", "0.0001"]) == 0
    captured = capsys.readouterr()
    assert f"wrote {len(expected):,} samples" in captured.out
    assert "merging" in captured.err and "sorted runs" in captured.err  # progress on stderr
    assert approx(read_output(out)) == approx(expected)
    with pytest.raises(SystemExit) as refused:  # argparse's usage error
        cli.main(["export", str(tmp_path / "run"), "--output", str(out), "--memory-gb", "0"])
    assert refused.value.code == 2
    assert "--memory-gb must be positive" in capsys.readouterr().err


def test_export_out_of_disk_says_what_needs_the_space_and_leaves_nothing(tmp_path, capsys, monkeypatch):
    import errno

    from orchestrator.export import sort as export_module

    make_run(tmp_path / "run", seed=5)
    real = export_module._write_sorted_runs

    def full_disk(paths, tmp, *args):
        real(paths[:2], tmp, *args)  # some runs are written, then the disk fills
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(export_module, "_write_sorted_runs", full_disk)
    out = tmp_path / "out" / "all.jsonl"
    assert cli.main(["export", str(tmp_path / "run"), "--output", str(out), "--memory-gb", "0.0001",
                     "--no-progress"]) == 2  # exit_codes.FAULT: the export stopped on a fault
    err = capsys.readouterr().err
    assert "out of disk space" in err and "--memory-gb" in err
    assert list((tmp_path / "out").iterdir()) == []  # no partial output, no sort runs


def test_export_refuses_an_unknown_extension_before_any_progress(tmp_path, capsys):
    make_run(tmp_path / "run", seed=5)
    assert cli.main(["export", str(tmp_path / "run"), "--output", str(tmp_path / "x.csv")]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "pagefleet export: --output must end in .jsonl or .parquet, got 'x.csv'"
    assert not (tmp_path / "x.csv").exists()


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_export_spreads_the_passed_through_columns_and_keeps_integer_ids(tmp_path, suffix):
    """Item 10: the input's other columns follow the record's fields and an integer id stays an integer, in both
    formats (parquet types the columns; a row without an id keeps its row number, as the ids' type)."""
    def columns(r: int) -> str | None:
        if r % 5 == 4:  # a row without an id: its prompt_id is its row number, as a string
            return json.dumps({"prompt": f"p{r}", "meta": None})
        return json.dumps({"prompt_id": r, "prompt": f"p{r}", "meta": {"k": r % 3, "tags": ["a"] * (r % 2)}})

    expected = make_run(tmp_path / "run", num_rows=30, num_batches=4, passthrough=columns, prompt_id=str)
    out = tmp_path / f"out{suffix}"
    assert export(tmp_path / "run", out) == len(expected)
    got = read_output(out)
    if suffix == ".parquet":  # row numbers as the ids' type; a struct column has every key, null where absent
        for e in expected:
            e["prompt_id"] = int(e["prompt_id"])
            e["meta"] = None if e["meta"] is None else e["meta"]
        assert pq.read_schema(out).field("prompt_id").type == pa.int64()
    assert approx(got) == approx(expected)
    assert list(got[0]) == [*(f for f in RECORD_FIELDS if f != "passthrough"), "prompt", "meta"]
    assert got[0]["prompt_id"] == 0 and got[0]["meta"] == {"k": 0, "tags": []}


def test_export_to_parquet_refuses_ids_of_mixed_types_in_one_line(tmp_path):
    make_run(tmp_path / "run", num_rows=12, num_batches=2,
             passthrough=lambda r: json.dumps({"prompt_id": r if r % 2 else f"s{r}"}),
             prompt_id=lambda r: str(r) if r % 2 else f"s{r}")
    with pytest.raises(ValueError, match=r"no common type across rows .*export to \.jsonl instead"):
        export(tmp_path / "run", tmp_path / "out.parquet")
    assert export(tmp_path / "run", tmp_path / "out.jsonl") == 36
    ids = [r["prompt_id"] for r in read_output(tmp_path / "out.jsonl")][::3]
    assert ids == [f"s{r}" if r % 2 == 0 else r for r in range(12)]


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_outputs_older_than_passed_through_columns_still_export(tmp_path, suffix):
    expected = make_run(tmp_path / "run", num_rows=20, num_batches=3)
    for path in (tmp_path / "run" / "outputs").glob("*.parquet"):
        pq.write_table(pq.read_table(path).drop_columns(["passthrough"]), path)
    assert export(tmp_path / "run", tmp_path / f"out{suffix}") == len(expected)
    assert approx(read_output(tmp_path / f"out{suffix}")) == approx(expected)


def test_export_holds_a_footer_at_a_time_and_the_distinct_passthrough_schemas(tmp_path, monkeypatch):
    """A samples file's parquet footer takes ~46 KB in memory: an export that kept every file's (a million batches at
    100M prompts) would need ~46 GB before its first sample. The passed-through columns' schemas are kept once each,
    not once a file."""
    from orchestrator.export import export as export_module

    class Footer:
        alive = peak = 0

        def __init__(self, meta):
            self._meta = meta
            Footer.alive += 1
            Footer.peak = max(Footer.peak, Footer.alive)

        def __getattr__(self, name):
            return getattr(self._meta, name)

        def __del__(self):
            Footer.alive -= 1

    real_metadata, real_unify = export_module.metadata, pa.unify_schemas
    unified = []
    monkeypatch.setattr(export_module, "metadata", lambda path: Footer(real_metadata(path)))
    monkeypatch.setattr(pa, "unify_schemas", lambda schemas, **kw: unified.append(len(schemas)) or real_unify(schemas, **kw))
    expected = make_run(tmp_path / "run", num_batches=40, passthrough=lambda r: json.dumps({"topic": f"t{r % 3}"}))
    for suffix in (".jsonl", ".parquet"):
        assert export(tmp_path / "run", tmp_path / f"out{suffix}") == len(expected)
    assert Footer.peak <= 2, Footer.peak
    assert unified == [1]  # the parquet export's: 40 files of one schema


def test_files_read_are_combined_as_they_come_with_the_same_export(tmp_path, monkeypatch):
    """Files' tables are combined every _COMPACT_FILES files (a small batch's table costs more to hold than its
    samples): the export is the same, in memory and sorted on disk."""
    from orchestrator.export import sort

    expected = make_run(tmp_path / "run", num_batches=20)
    monkeypatch.setattr(sort, "_COMPACT_FILES", 3)
    for budget, name in ((sort.DEFAULT_MEMORY_BYTES, "memory.jsonl"), (100_000, "disk.jsonl")):
        assert export(tmp_path / "run", tmp_path / name, memory_bytes=budget) == len(expected)
        assert approx(read_output(tmp_path / name)) == approx(expected)


def test_the_export_command_reads_the_manifest_once_and_each_footer_once(tmp_path, monkeypatch, capsys):
    """At a million batches a footer read costs ~0.07 ms and the manifest ~6 s: the command read every footer two to
    four times (the progress bar's total, the sort's size, the sample count check) and the manifest twice."""
    from orchestrator.export import export as export_module

    expected = make_run(tmp_path / "run", num_batches=12, seed=5)
    footers, manifests = [], []
    real_metadata, real_read_manifest = export_module.metadata, export_module.read_manifest
    monkeypatch.setattr(export_module, "metadata", lambda path: footers.append(path) or real_metadata(path))
    monkeypatch.setattr(export_module, "read_manifest", lambda path: manifests.append(path) or real_read_manifest(path))
    monkeypatch.setattr(export_module, "check_manifest", lambda run_dir, records: None)  # make_run writes no plan
    out = tmp_path / "all.jsonl"
    assert cli.main(["export", str(tmp_path / "run"), "--output", str(out), "--no-progress"]) == 0
    assert f"wrote {len(expected):,} samples" in capsys.readouterr().out
    assert len(manifests) == 1 and len(footers) == len(set(footers)) == 12, (len(manifests), len(footers))
