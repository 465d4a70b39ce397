"""A finished run directory edited as a careless operator would: the weights changed in place, the manifest
(batches.jsonl) edited into other valid JSON. Every outcome is the original export or a refusal in one line naming
the cause; never a different export with exit status 0.

One real run (tiny-llama, 24 prompts in small batches) serves the module; each test edits copies of it.
"""

from __future__ import annotations

import json
import random
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

from orchestrator.commands.cli import main
from orchestrator.config import load_run_config
from orchestrator.run.driver import Driver

from ..conftest import run_args, write_run_corpus

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def finished(ray_local, run_model, tmp_path_factory) -> dict:
    """{root, model, config, corpus, run_dir, export}: a finished run on its own copy of the model, and its export."""
    root = tmp_path_factory.mktemp("finished")
    model = Path(shutil.copytree(run_model, root / "model"))
    corpus = write_run_corpus(root / "corpus.jsonl", 24)
    config = root / "run.yaml"
    config.write_text("name: edits\n")
    run_dir = root / "run"
    cfg = load_run_config(config, run_args(str(model), corpus, run_dir, "--packing.max_prefill_steps=1",
                                           "--cluster.num_slices=1"))
    assert Driver(cfg, show_progress=False).run().exit_code == 0
    out = root / "original.jsonl"
    assert main(["export", str(run_dir), "--output", str(out)]) == 0
    return {"root": root, "model": model, "config": config, "corpus": corpus, "run_dir": run_dir,
            "export": out.read_bytes()}


def copy_run(finished: dict, dest: Path) -> Path:
    return Path(shutil.copytree(finished["run_dir"], dest))


def lines(run_dir: Path) -> list[str]:
    return (run_dir / "batches.jsonl").read_text().splitlines(keepends=True)


def export_of(run_dir: Path, out: Path, capsys, *extra: str) -> tuple[int, bytes | None, str]:
    """(exit status, the export's bytes or None, stderr) of `pagefleet export`."""
    capsys.readouterr()
    code = main(["export", str(run_dir), "--output", str(out), *extra])
    err = capsys.readouterr().err
    return code, (out.read_bytes() if out.exists() else None), err


def rerun(finished: dict, run_dir: Path, capsys) -> tuple[int, str]:
    capsys.readouterr()
    code = main(["run", str(finished["config"]), *run_args(str(finished["model"]), finished["corpus"], run_dir,
                                                           "--packing.max_prefill_steps=1", "--cluster.num_slices=1")])
    return code, capsys.readouterr().err


def refused_in_one_line(err: str, *words: str) -> None:
    text = err.strip()
    assert text and all(w in text for w in words), text
    assert "Traceback" not in text, text


# -- item 1: weights changed in place --------------------------------------------------------------

def scale_tensor_in_place(model: Path, name: str, factor: float) -> None:
    """Multiply one float32 tensor of model.safetensors by `factor`, writing its bytes where they are: the file keeps
    its size and header."""
    path = model / "model.safetensors"
    with open(path, "r+b") as f:
        length = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(length))
        start, end = header[name]["data_offsets"]
        assert header[name]["dtype"] == "F32"
        f.seek(8 + length + start)
        values = np.frombuffer(f.read(end - start), dtype="<f4") * np.float32(factor)
        f.seek(8 + length + start)
        f.write(values.astype("<f4").tobytes())


def test_weights_changed_in_place_are_refused_never_mixed(finished, tmp_path, capsys):
    run_dir = copy_run(finished, tmp_path / "run")
    outputs = sorted((run_dir / "outputs").glob("*.parquet"))
    for path in outputs[: len(outputs) // 2]:  # as a crash leaves them: half the batches still to run
        path.unlink()
    model = finished["model"]
    original = (model / "model.safetensors").read_bytes()
    header_before = original[: 8 + struct.unpack("<Q", original[:8])[0]]
    try:
        scale_tensor_in_place(model, "model.layers.0.mlp.down_proj.weight", 3.0)
        changed = (model / "model.safetensors").read_bytes()
        assert len(changed) == len(original) and changed.startswith(header_before) and changed != original
        code, err = rerun(finished, run_dir, capsys)
        assert code != 0
        refused_in_one_line(err, "model.safetensors", "changed since the run was planned")
        assert len(list((run_dir / "outputs").glob("*.parquet"))) == len(outputs) - len(outputs) // 2  # none added
    finally:
        (model / "model.safetensors").write_bytes(original)  # rewritten: a new mtime, the recorded content
    code, err = rerun(finished, run_dir, capsys)  # the same bytes again: re-hashed, accepted, finished
    assert code == 0, err
    assert export_of(run_dir, tmp_path / "out.jsonl", capsys)[1] == finished["export"]


def test_run_json_records_every_weight_file(finished):
    info = json.loads((finished["run_dir"] / "run.json").read_text())
    record = info["weights"]["model.safetensors"]
    assert record["size"] == (finished["model"] / "model.safetensors").stat().st_size
    assert {"header_sha256", "version", "sha256"} <= record.keys()
    assert "weights" in info["fingerprints"]


# -- item 2: the manifest checked against the plan ------------------------------------------------

def test_a_deleted_manifest_line_is_named_by_status_and_export_and_restored_by_run(finished, tmp_path, capsys):
    run_dir = copy_run(finished, tmp_path / "run")
    kept = lines(run_dir)
    (run_dir / "batches.jsonl").write_text("".join(kept[:2] + kept[3:]))
    capsys.readouterr()
    assert main(["status", str(run_dir)]) != 0
    refused_in_one_line(capsys.readouterr().err, "batches.jsonl", "prompts", "accepted")
    code, data, err = export_of(run_dir, tmp_path / "out.jsonl", capsys)
    assert code != 0 and data is None
    refused_in_one_line(err, "batches.jsonl")
    code, err = rerun(finished, run_dir, capsys)
    assert code == 0, err
    assert "restored from" in (run_dir / "events.log").read_text()
    assert len(lines(run_dir)) == len(kept)
    assert export_of(run_dir, tmp_path / "out.jsonl", capsys)[1] == finished["export"]


def test_a_duplicated_manifest_line_is_named_and_dropped_by_run(finished, tmp_path, capsys):
    run_dir = copy_run(finished, tmp_path / "run")
    kept = lines(run_dir)
    (run_dir / "batches.jsonl").write_text("".join(kept + [kept[1]]))
    capsys.readouterr()
    assert main(["status", str(run_dir)]) != 0
    refused_in_one_line(capsys.readouterr().err, "appears 2 times")
    code, data, err = export_of(run_dir, tmp_path / "out.jsonl", capsys)
    assert code != 0 and data is None
    refused_in_one_line(err, "appears 2 times")
    code, err = rerun(finished, run_dir, capsys)
    assert code == 0, err
    assert len(lines(run_dir)) == len(kept)
    assert export_of(run_dir, tmp_path / "out.jsonl", capsys)[1] == finished["export"]


def test_duplicate_lines_that_differ_are_refused_by_run_in_one_line(finished, tmp_path, capsys):
    run_dir = copy_run(finished, tmp_path / "run")
    kept = lines(run_dir)
    other = json.loads(kept[1])
    other["status"] = "pending"
    (run_dir / "batches.jsonl").write_text("".join(kept + [json.dumps(other) + "\n"]))
    code, err = rerun(finished, run_dir, capsys)
    assert code != 0
    refused_in_one_line(err, other["batch_id"], "more than once with different contents")
    assert len(err.strip().splitlines()) == 1, err
    assert len(lines(run_dir)) == len(kept) + 1  # refused: nothing rewritten


def test_an_output_pointed_at_another_batch_is_refused_by_partial_export(finished, tmp_path, capsys):
    run_dir = copy_run(finished, tmp_path / "run")
    records = [json.loads(line) for line in lines(run_dir)]
    records[0]["output"] = records[1]["output"]
    records[2]["status"] = "pending"  # an unfinished run: export --partial
    (run_dir / "batches.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    code, data, err = export_of(run_dir, tmp_path / "out.jsonl", capsys, "--partial")
    assert code != 0 and data is None
    refused_in_one_line(err, records[0]["batch_id"], records[1]["output"])
    code, err = rerun(finished, run_dir, capsys)
    assert code == 0, err
    assert export_of(run_dir, tmp_path / "out.jsonl", capsys)[1] == finished["export"]


# -- the fuzz test ------------------------------------------------------------------------------

def edited(text: str, rng: random.Random) -> str:
    """One or two random edits of the manifest's text: delete, duplicate, reorder, change a field, truncate."""
    for _ in range(rng.choice((1, 1, 2))):
        rows = text.splitlines(keepends=True)
        kind = rng.choice(("delete", "duplicate", "reorder", "field", "truncate"))
        i = rng.randrange(len(rows))
        if kind == "delete":
            del rows[i]
        elif kind == "duplicate":
            rows.insert(rng.randrange(len(rows) + 1), rows[i])
        elif kind == "reorder":
            rng.shuffle(rows)
        elif kind == "field":
            record = json.loads(rows[i])
            key = rng.choice(sorted(record))
            other = json.loads(rows[rng.randrange(len(rows))])
            record[key] = rng.choice((other[key], None, "x", -1, 0, 1.5, record[key] if not isinstance(
                record[key], int) or isinstance(record[key], bool) else record[key] + rng.choice((-1, 1))))
            rows[i] = json.dumps(record) + "\n"
        else:
            text = "".join(rows)
            return text[: rng.randrange(len(text))]
        text = "".join(rows)
    return text


def test_fuzzed_manifest_edits_export_the_original_or_are_refused(finished, tmp_path, capsys):
    original = (finished["run_dir"] / "batches.jsonl").read_text()
    run_dir = copy_run(finished, tmp_path / "run")
    rng = random.Random(41)
    want = finished["export"].decode().splitlines()
    outcomes = {"identical": 0, "refused": 0}
    for trial in range(120):
        text = edited(original, rng)
        (run_dir / "batches.jsonl").write_text(text)
        out = tmp_path / f"out-{trial}.jsonl"
        for extra in ((), ("--partial",)):
            code, data, err = export_of(run_dir, out, capsys, *extra)
            if code == 0 and extra:  # what is done, each sample once: a part of the original, in its order
                got = data.decode().splitlines()
                assert len(set(got)) == len(got) and set(got) <= set(want), f"trial {trial} --partial:\n{text}"
                assert got == [line for line in want if line in set(got)]
            elif code == 0:
                assert data == finished["export"], f"trial {trial}: a different export with exit 0:\n{text}"
                outcomes["identical"] += 1
            else:
                assert data is None, f"trial {trial}: refused but wrote an export"
                refused_in_one_line(err)
                assert len(err.strip().splitlines()) == 1, err
                outcomes["refused"] += 1
            out.unlink(missing_ok=True)
    assert outcomes["identical"] and outcomes["refused"], outcomes
