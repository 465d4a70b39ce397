"""The fault matrix of issue 26 (items 3, 5, 6 and 7): each fault is detected, named in one line, classified by
its exit status (orchestrator/exit_codes.py), never retried when retrying cannot help, and recoverable as
docs/faults.md says, after which the export is complete and exact.

The runs are the real command (`orchestrator.commands.cli.main`) on a local Ray, in this process where the fault can be
made here (a crash point that raises ENOSPC, a damaged file), in a subprocess where the process itself is the
subject (its umask, where its Ray session goes).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from safetensors.numpy import load_file, save_file

from orchestrator import exit_codes
from orchestrator.state import faults
from orchestrator.commands.cli import main
from orchestrator.state.manifest import read_manifest

from ..conftest import run_args, write_run_corpus, write_tiny_model

pytestmark = pytest.mark.ray


# -- helpers ----------------------------------------------------------------------------------------

def pagefleet(capsys, *argv: str) -> tuple[int, str]:
    """Run the command line in this process: (exit status, its stderr)."""
    capsys.readouterr()
    code = main(list(argv))
    return code, capsys.readouterr().err


def run(capsys, config: Path, model: str, corpus: str, run_dir: Path, *extra: str) -> tuple[int, str]:
    return pagefleet(capsys, "run", str(config), *run_args(model, corpus, run_dir, "--cluster.num_slices=1", *extra))


def exported(capsys, run_dir: Path, output: Path) -> list[dict]:
    code, err = pagefleet(capsys, "export", str(run_dir), "--output", str(output), "--no-progress")
    assert code == exit_codes.OK, err
    return [json.loads(line, parse_constant=_no_constant) for line in output.read_text().splitlines()]


def _no_constant(name: str):
    raise AssertionError(f"bare {name} in JSON output")


def one_line(err: str, *needles: str) -> str:
    """The stderr line naming every needle (a fault is one line, not a traceback). Ray's loggers may still
    hold an earlier test's captured stderr, and its complaint about that closed stream is not ours: skipped."""
    err = re.sub(r"--- Logging error ---.*?\nArguments: [^\n]*\n", "", err, flags=re.DOTALL)
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if all(n in line for n in needles)]
    assert lines, f"no line names {needles}:\n{err}"
    return lines[0]


def copy_model(src: str, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_tensor(model: Path, name: str, edit) -> None:
    tensors = load_file(str(model / "model.safetensors"))
    tensors[name] = edit(tensors[name].copy())
    save_file(tensors, str(model / "model.safetensors"), metadata={"format": "pt"})


def poke_nan(w: np.ndarray) -> np.ndarray:
    w[3, 5] = np.nan
    return w


def drop_chat_template(model: Path) -> None:
    (model / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def done_run(ray_local, run_model, tmp_path_factory):
    """A finished run (greedy, 16 prompts, several batches) and its export: the exact reference."""
    root = tmp_path_factory.mktemp("done")
    corpus = write_run_corpus(root / "corpus.jsonl", 16, seed=5)
    config = root / "run.yaml"
    config.write_text("name: faults\n")
    run_dir = root / "run"
    assert main(["run", str(config), *run_args(run_model, corpus, run_dir, "--cluster.num_slices=1",
                                               "--packing.max_prefill_steps=1")]) == exit_codes.OK
    output = root / "reference.jsonl"
    assert main(["export", str(run_dir), "--output", str(output), "--no-progress"]) == exit_codes.OK
    return {"config": config, "corpus": corpus, "run_dir": run_dir,
            "reference": [json.loads(line) for line in output.read_text().splitlines()]}


def copy_run(done_run: dict, tmp_path: Path) -> Path:
    run_dir = tmp_path / "run"
    shutil.copytree(done_run["run_dir"], run_dir, ignore=shutil.ignore_patterns(".lock"))
    return run_dir


def rerun(capsys, done_run: dict, run_model: str, run_dir: Path) -> tuple[int, str]:
    return run(capsys, done_run["config"], run_model, done_run["corpus"], run_dir, "--packing.max_prefill_steps=1")


# -- 3. non-finite numbers never pass -----------------------------------------------------------------

def test_nan_weights_are_named_at_load_and_stop_the_run_without_restarts(ray_local, run_model, tmp_path, capsys):
    model = copy_model(run_model, tmp_path / "nan-model")
    name = "model.layers.1.mlp.down_proj.weight"
    edit_tensor(model, name, poke_nan)
    (tmp_path / "in.jsonl").write_text('{"id": "a", "prompt": "hello"}\n')
    code, err = pagefleet(capsys, "generate", "--model", str(model), "--input", str(tmp_path / "in.jsonl"),
                          "--output", str(tmp_path / "out.jsonl"), "--engine.max_seq_len=128", "--engine.max_pages=32",
                          "--progress=false")
    assert code == exit_codes.FAULT
    one_line(err, str(model / "model.safetensors"), name, "NaN")
    assert not (tmp_path / "out.jsonl").exists()

    corpus = write_run_corpus(tmp_path / "corpus.jsonl", 4)
    config = tmp_path / "run.yaml"
    config.write_text("name: nan\n")
    code, err = run(capsys, config, str(model), corpus, tmp_path / "run", "--cluster.max_slice_restarts=3")
    assert code == exit_codes.FAULT
    one_line(err, "stopped on a fault", name, "NaN")
    events = (tmp_path / "run" / "events.log").read_text()
    assert "slice-0 could not start" in events and "slice-0 restarting" not in events  # deterministic: no restarts


def test_non_finite_logits_fail_their_batch_once_and_json_never_holds_nan(ray_local, run_model, tmp_path, capsys):
    """Finite weights whose logits overflow (a final norm of 3e38): every sample's logits are Inf/NaN."""
    model = copy_model(run_model, tmp_path / "overflow")
    edit_tensor(model, "model.norm.weight", lambda w: np.full_like(w, 3e38))
    rows = ['{"id": "a", "prompt": "hello world"}', '{"id": "b", "prompt_token_ids": [1, 2, 3]}']
    (tmp_path / "in.jsonl").write_text("\n".join(rows) + "\n")
    out, stats = tmp_path / "out.jsonl", tmp_path / "stats.json"
    code, err = pagefleet(capsys, "generate", "--model", str(model), "--input", str(tmp_path / "in.jsonl"),
                          "--output", str(out), "--stats_output", str(stats), "--sampling.logprobs=true",
                          "--sampling.max_new_tokens=4", "--engine.max_seq_len=128", "--engine.max_pages=32",
                          "--progress=false")
    records = [json.loads(line, parse_constant=_no_constant) for line in out.read_text().splitlines()]
    json.loads(stats.read_text(), parse_constant=_no_constant)
    assert [r["prompt_id"] for r in records] == ["a", "b"]
    assert all(r["error"].startswith("non_finite:") and r["token_ids"] == [] and r["logprobs"] is None
               for r in records)

    corpus = write_run_corpus(tmp_path / "corpus.jsonl", 6)
    config = tmp_path / "run.yaml"
    config.write_text("name: overflow\n")
    run_dir = tmp_path / "run"
    code, err = run(capsys, config, str(model), corpus, run_dir, "--retry.max_attempts=3")
    assert code == exit_codes.BATCHES_FAILED
    one_line(err, "batches failed")
    records = read_manifest(run_dir / "batches.jsonl")
    assert records and all(r.status == "failed" and r.attempts == 1 and "non_finite" in r.error for r in records)
    code, err = pagefleet(capsys, "status", str(run_dir), "--json")
    assert code == exit_codes.OK


def test_export_writes_null_for_a_non_finite_logprob(done_run, run_model, tmp_path, capsys):
    """An output written before non-finite logits were caught: its export is still JSON."""
    run_dir = copy_run(done_run, tmp_path)
    path = next((run_dir / "outputs").glob("*.parquet"))
    table = pq.read_table(path)
    logprobs = table["logprobs"].to_pylist()
    logprobs[0] = [math.nan] * len(table["token_ids"][0].as_py())
    import pyarrow as pa

    table = table.set_column(table.schema.get_field_index("logprobs"), "logprobs",
                             pa.array(logprobs, table.schema.field("logprobs").type))
    pq.write_table(table, path)
    records = exported(capsys, run_dir, tmp_path / "out.jsonl")
    assert any(r["logprobs"] and None in r["logprobs"] for r in records)


# -- 5. bad rows are rows -----------------------------------------------------------------------------

def test_deep_rows_chats_without_a_template_and_out_of_vocabulary_ids_are_rejected_rows(ray_local, tmp_path, capsys):
    model = Path(write_tiny_model(tmp_path / "model"))
    drop_chat_template(model)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    vocab_size = 260  # the byte alphabet and the specials: a merged token (tokenizer id >= 260) has no embedding
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "vocab_size": vocab_size}))
    good, oov = "zqv kxj", "the quick brown fox"
    assert max(tok(good)["input_ids"]) < vocab_size <= max(tok(oov)["input_ids"])
    rows = ['{"id": "deep", "prompt": "x", "meta": ' + "[" * 100_000 + "]" * 100_000 + "}",
            json.dumps({"id": "chat", "messages": [{"role": "user", "content": good}]}),
            json.dumps({"id": "oov", "prompt": oov}),
            json.dumps({"id": "ok", "prompt": good})]
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(rows) + "\n")
    (tmp_path / "plan.yaml").write_text("name: rows\n")
    run_dir = tmp_path / "run"
    code, err = pagefleet(capsys, "plan", str(tmp_path / "plan.yaml"), *run_args(str(model), str(corpus), run_dir))
    assert code == exit_codes.OK, err
    rejected = {r["prompt_id"] or f"row-{r['row']}": r
                for r in map(json.loads, (run_dir / "rejected.jsonl").read_text().splitlines())}
    assert rejected["row-0"]["reason"] == "malformed_row" and "nested too deeply" in rejected["row-0"]["detail"]
    assert rejected["row-0"]["line"] == 1 and rejected["row-0"]["file"] == str(corpus)
    assert rejected["chat"]["reason"] == "no_chat_template" and str(model) in rejected["chat"]["detail"]
    assert rejected["oov"]["reason"] == "out_of_vocabulary" and "vocab_size" in rejected["oov"]["detail"]
    assert "ok" not in rejected
    batches = pq.read_table(next((run_dir / "batches").glob("*.parquet")))
    assert batches["prompt_id"].to_pylist() == ["ok"]


def test_generate_judges_deep_rows_and_chats_without_a_template_line_by_line(run_model, tmp_path, capsys):
    model = copy_model(run_model, tmp_path / "no-template")
    drop_chat_template(model)
    rows = ['{"id": "deep", "prompt": "x", "meta": ' + "[" * 100_000 + "]" * 100_000 + "}",
            json.dumps({"id": "chat", "messages": [{"role": "user", "content": "hi"}]}),
            json.dumps({"id": "oov", "prompt_token_ids": [1, 600]}),
            json.dumps({"id": "ok", "prompt": "hello"})]
    (tmp_path / "in.jsonl").write_text("\n".join(rows) + "\n")
    out = tmp_path / "out.jsonl"
    code, err = pagefleet(capsys, "generate", "--model", str(model), "--input", str(tmp_path / "in.jsonl"),
                          "--output", str(out), "--sampling.max_new_tokens=4", "--engine.max_seq_len=128",
                          "--engine.max_pages=32", "--progress=false")
    assert code == exit_codes.OK, err
    by = {r["prompt_id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert by["line-1"]["error"].startswith("malformed_row: line 1") and "nested too deeply" in by["line-1"]["error"]
    assert by["chat"]["error"].startswith("no_chat_template:")
    assert by["oov"]["error"].startswith("out_of_vocabulary:") and "vocab_size" in by["oov"]["error"]
    assert "error" not in by["ok"] and by["ok"]["token_ids"]


# -- 6. faults are named and classified ---------------------------------------------------------------

def test_disk_full_is_one_line_in_stderr_and_events_and_the_rerun_is_exact(done_run, run_model, tmp_path, capsys,
                                                                            monkeypatch):
    run_dir = tmp_path / "run"
    monkeypatch.setattr(faults, "_seen", {})
    monkeypatch.setenv("PAGEFLEET_DISK_FULL_AT", "output_tmp:2")
    code, err = rerun(capsys, done_run, run_model, run_dir)
    assert code == exit_codes.FAULT
    line = one_line(err, "out of disk space", str(run_dir / "outputs"))
    assert "rerun" in line
    assert "out of disk space" in (run_dir / "events.log").read_text()
    monkeypatch.delenv("PAGEFLEET_DISK_FULL_AT")
    code, err = rerun(capsys, done_run, run_model, run_dir)
    assert code == exit_codes.OK, err
    assert exported(capsys, run_dir, tmp_path / "out.jsonl") == done_run["reference"]


@pytest.mark.parametrize("name, damage", [
    ("batches.jsonl", lambda text: text[:-40]),  # the last record cut short
    ("run.json", lambda text: text.replace('"plan"', '"plan" 17', 1)),
])
def test_a_corrupt_manifest_or_run_json_is_named_with_its_line_and_the_recovery_is_exact(
        done_run, run_model, tmp_path, capsys, name, damage):
    run_dir = copy_run(done_run, tmp_path)
    path = run_dir / name
    text = path.read_text()
    path.write_text(damage(text))
    expected_line = text[:-40].count("\n") + 1 if name == "batches.jsonl" else \
        text[:text.index('"plan"')].count("\n") + 1
    for command in (["status", str(run_dir)], None):
        code, err = pagefleet(capsys, *command) if command else rerun(capsys, done_run, run_model, run_dir)
        assert code == exit_codes.FAULT
        one_line(err, f"{path} line {expected_line}", "remove it and rerun")
    path.unlink()  # the documented recovery
    outputs = {p.name: p.stat().st_mtime_ns for p in (run_dir / "outputs").glob("*.parquet")}
    code, err = rerun(capsys, done_run, run_model, run_dir)
    assert code == exit_codes.OK, err
    assert {p.name: p.stat().st_mtime_ns for p in (run_dir / "outputs").glob("*.parquet")} == outputs  # adopted
    assert exported(capsys, run_dir, tmp_path / "out.jsonl") == done_run["reference"]


def test_a_truncated_output_is_named_by_export_and_recomputed_on_start(done_run, run_model, tmp_path, capsys):
    run_dir = copy_run(done_run, tmp_path)
    path = run_dir / "outputs" / "b000001.parquet"
    path.write_bytes(path.read_bytes()[:200])
    code, err = pagefleet(capsys, "export", str(run_dir), "--output", str(tmp_path / "x.jsonl"), "--no-progress")
    assert code == exit_codes.FAULT
    one_line(err, str(path), "corrupt or truncated", "pagefleet run")
    code, err = rerun(capsys, done_run, run_model, run_dir)
    assert code == exit_codes.OK, err
    events = (run_dir / "events.log").read_text()
    assert f"{path} is corrupt or truncated" in events and "b000001 running on" in events
    assert exported(capsys, run_dir, tmp_path / "out.jsonl") == done_run["reference"]


def test_a_missing_batch_file_fails_its_batch_once_and_replanning_recovers(done_run, run_model, tmp_path, capsys):
    run_dir = tmp_path / "run"
    args = run_args(run_model, done_run["corpus"], run_dir, "--cluster.num_slices=1", "--packing.max_prefill_steps=1")
    code, err = pagefleet(capsys, "plan", str(done_run["config"]), *args)
    assert code == exit_codes.OK, err
    missing = run_dir / "batches" / "b000001.parquet"
    missing.unlink()
    code, err = rerun(capsys, done_run, run_model, run_dir)
    assert code == exit_codes.BATCHES_FAILED
    one_line(err, "b000001", str(missing), "missing")
    records = {r.batch_id: r for r in read_manifest(run_dir / "batches.jsonl")}
    assert records["b000001"].status == "failed" and records["b000001"].attempts == 1  # never retried
    assert all(r.status == "done" for k, r in records.items() if k != "b000001")
    (run_dir / "batches.jsonl").unlink()  # the recovery the error names: re-plan, adopting what is done
    code, err = rerun(capsys, done_run, run_model, run_dir)
    assert code == exit_codes.OK, err
    assert exported(capsys, run_dir, tmp_path / "out.jsonl") == done_run["reference"]


def _vocab(model: Path) -> None:
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "vocab_size": config["vocab_size"] + 64}))


def _truncate(model: Path) -> None:
    path = model / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-1000])


def _shape(model: Path) -> None:
    edit_tensor(model, "model.layers.0.mlp.up_proj.weight", lambda w: w[:-8])


@pytest.mark.parametrize("damage, needles", [
    (_vocab, ["model.safetensors", "model.embed_tokens.weight", "vocab_size=576"]),
    (_truncate, ["model.safetensors", "truncated"]),
    (_shape, ["model.safetensors", "model.layers.0.mlp.up_proj.weight", "intermediate_size=128"]),
])
def test_checkpoint_faults_are_named_at_the_head_before_any_slice(ray_local, run_model, tmp_path, capsys, damage,
                                                                   needles):
    model = copy_model(run_model, tmp_path / "model")
    damage(model)
    corpus = write_run_corpus(tmp_path / "corpus.jsonl", 4)
    config = tmp_path / "run.yaml"
    config.write_text("name: ckpt\n")
    code, err = run(capsys, config, str(model), corpus, tmp_path / "run", "--cluster.max_slice_restarts=0")
    assert code == exit_codes.FAULT
    one_line(err, *needles)
    assert not (tmp_path / "run" / "batches.jsonl").exists()  # found before planning, let alone a slice


def test_a_crash_of_the_head_exits_fault_not_batches_failed(ray_local, run_model, tmp_path, capsys, monkeypatch):
    import orchestrator.run.driver

    def crash(cfg):
        raise KeyError("boom")

    monkeypatch.setattr(orchestrator.run.driver, "plan_locked", crash)  # where the head calls it
    corpus = write_run_corpus(tmp_path / "corpus.jsonl", 4)
    config = tmp_path / "run.yaml"
    config.write_text("name: crash\n")
    code, err = run(capsys, config, run_model, corpus, tmp_path / "run")
    assert code == exit_codes.FAULT
    one_line(err, "internal error", "KeyError", "PAGEFLEET_DEBUG")


# -- 7. leftovers --------------------------------------------------------------------------------------

def test_export_removes_what_a_killed_export_left(done_run, tmp_path, capsys):
    output = tmp_path / "out" / "samples.jsonl"
    output.parent.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = socket.gethostname()
    half_written = output.parent / ".samples.jsonl.k3j2h1.tmp"
    half_written.write_text("{}\n" * 100)
    killed_sort = output.parent / f".pagefleet-export-{host}-{dead.pid}-abc123"
    (killed_sort / "run-000000.parquet").parent.mkdir()
    (killed_sort / "run-000000.parquet").write_bytes(b"x" * 1000)
    live_sort = output.parent / f".pagefleet-export-{host}-{os.getpid()}-def456"  # a live export's: kept
    live_sort.mkdir()
    assert exported(capsys, done_run["run_dir"], output) == done_run["reference"]
    assert not half_written.exists() and not killed_sort.exists() and live_sort.exists()


def test_outputs_follow_the_umask_and_local_ray_stays_out_of_the_shared_tmp(run_in_own_process, run_model, tmp_path,
                                                                            capsys):
    # generate, in this process: its output reads like any file the user writes (it was 0600 whatever the umask)
    umask = os.umask(0)
    os.umask(umask)
    (tmp_path / "in.jsonl").write_text('{"id": "a", "prompt": "hello"}\n')
    code, err = pagefleet(capsys, "generate", "--model", run_model, "--input", str(tmp_path / "in.jsonl"),
                          "--output", str(tmp_path / "gen.jsonl"), "--sampling.max_new_tokens=2",
                          "--engine.max_seq_len=128", "--engine.max_pages=32", "--progress=false")
    assert code == exit_codes.OK, err
    assert (tmp_path / "gen.jsonl").stat().st_mode & 0o777 == 0o666 & ~umask

    # run, in a process of its own with umask 027 and its own local Ray (tests/orchestrator/conftest.py's
    # `run_in_own_process`, whose stderr test_progress.py reads)
    pid, run_dir = run_in_own_process["pid"], run_in_own_process["run_dir"]
    assert run_in_own_process["returncode"] == exit_codes.OK, run_in_own_process["stderr"][-3000:]
    for path in [run_dir / "batches.jsonl", run_dir / "run.json", run_dir / "rejected.jsonl", run_dir / "events.log",
                 *(run_dir / "outputs").glob("*.parquet"), *(run_dir / "batches").glob("*.parquet")]:
        assert path.stat().st_mode & 0o777 == 0o640, path
    for path in [run_dir, run_dir / "outputs", run_dir / "batches"]:
        assert path.stat().st_mode & 0o777 == 0o750, path
    own = Path("/tmp") / f"pagefleet-ray-{os.getuid()}"
    assert own.stat().st_mode & 0o777 == 0o700 and own.stat().st_uid == os.getuid()
    assert list(own.glob(f"ray/session_*_{pid}")), f"no Ray session of pid {pid} under {own}"
    # none of its own in the shared /tmp/ray (a session there of the same pid number from before it started is
    # another process's: pids are reused)
    assert not set(Path("/tmp/ray").glob(f"session_*_{pid}")) - run_in_own_process["shared_sessions_before"]
