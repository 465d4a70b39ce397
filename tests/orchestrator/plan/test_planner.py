import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from orchestrator.config import load_run_config
from orchestrator.state.lock import RunDirLocked, RunLock
from orchestrator.state.manifest import read_manifest
from orchestrator.plan.packing import PackingLimits
from orchestrator.plan.planner import plan
from orchestrator.state.rundir import PlanMismatch

DEMO = Path(__file__).resolve().parents[3] / "configs" / "demo.yaml"

pytestmark = pytest.mark.ray

MANIFEST_KEYS = ["batch_id", "status", "num_prompts", "num_prompt_tokens", "num_pages", "attempts", "error", "slice",
                 "started_at", "finished_at", "output"]
BAD_LINES = [  # (line bytes, reason)
    (b"{not json", "malformed_row"),
    (b'{"id": "u", "prompt": "caf\xe9"}', "undecodable"),
    (b'{"id": "m", "text": "hi"}', "missing_field"),
    (b'{"id": "w", "prompt": 7}', "wrong_type"),
    (b'{"id": "e", "prompt": ""}', "empty_prompt"),
    (b'{"id": "l", "prompt": "' + b"the quick brown fox " * 40 + b'"}', "too_long"),
    (b'{"id": "p0", "prompt": "duplicate id"}', "duplicate_id"),
]


def write_corpus(path: Path, num_good: int = 120, seed: int = 0) -> dict[int, str]:
    """Good rows (text and chat) with bad ones mixed in; returns {row: expected reason}."""
    rng = np.random.default_rng(seed)
    words = ["the", "quick", "brown", "fox", "sea", "poem", "hello", "world"]
    lines, bad = [], {}
    for i in range(num_good):
        text = " ".join(rng.choice(words, int(rng.lognormal(2.0, 0.7)) + 1))
        if i % 5 == 0:
            lines.append(json.dumps({"id": f"p{i}", "messages": [{"role": "user", "content": text}]}).encode())
        elif i % 7 == 0:
            lines.append(json.dumps({"prompt": text}).encode())  # no id: its row number
        else:
            lines.append(json.dumps({"id": f"p{i}", "prompt": text}).encode())
        if i % 17 == 3 and len(bad) < len(BAD_LINES):
            line, reason = BAD_LINES[len(bad)]
            bad[len(lines)] = reason
            lines.append(line)
    path.write_bytes(b"\n".join(lines) + b"\n")
    return bad


def config(model, corpus, run_dir, *extra):
    return load_run_config(None, [f"--model.path={model}", f"--corpus.path={corpus}", f"--run_dir={run_dir}",
                                  "--sampling.max_new_tokens=16", "--engine.max_seq_len=128", "--engine.max_pages=48",
                                  "--engine.max_seqs=8", "--engine.max_seqs_in_prefill=4", "--engine.max_prefill_size=64",
                                  "--packing.max_prefill_steps=4", "--corpus.shard_bytes=700", *extra])


def read_batches(run_dir: Path) -> dict[str, list[dict]]:
    return {p.stem: pq.read_table(p).to_pylist() for p in sorted((run_dir / "batches").glob("*.parquet"))}


def test_plan_accounts_for_every_row(tiny_model, tmp_path, ray_local):
    bad = write_corpus(tmp_path / "c.jsonl")
    cfg = config(tiny_model, tmp_path / "c.jsonl", tmp_path / "run")
    result = plan(cfg)
    run = tmp_path / "run"
    rejected = [json.loads(line) for line in (run / "rejected.jsonl").read_text().splitlines()]
    assert {r["row"]: r["reason"] for r in rejected} == bad
    assert all(r["line"] == r["row"] + 1 and r["file"].endswith("c.jsonl") for r in rejected)

    records = read_manifest(run / "batches.jsonl")
    # docs/run-directory.md's manifest keys first, in order; the fields the run adds (tokens, occupancy, ...) follow.
    lines = (run / "batches.jsonl").read_text().splitlines()
    assert [list(json.loads(line))[:len(MANIFEST_KEYS)] for line in lines] == [MANIFEST_KEYS] * len(records)
    assert all(r.status == "pending" and r.attempts == 0 and r.output is None for r in records)
    batches = read_batches(run)
    assert list(batches) == [r.batch_id for r in records]
    limits = PackingLimits.resolve(cfg.packing, cfg.engine, cfg.sampling)
    seen = []
    for record in records:
        prompts = batches[record.batch_id]
        lengths = np.array([len(p["token_ids"]) for p in prompts])
        assert record.num_prompts == len(prompts) and record.num_prompt_tokens == lengths.sum()
        assert record.num_pages == limits.page_need(lengths).sum() <= limits.max_pages
        assert lengths.sum() <= limits.max_prompt_tokens and len(prompts) <= min(limits.max_seqs, limits.max_prompts)
        seen += [p["row"] for p in prompts]
    rows_read = result.stats.rows_read
    assert sorted(seen + list(bad)) == list(range(rows_read))  # exactly once, and accepted + rejected = read
    assert result.stats.accepted == len(seen) and sum(result.stats.rejected.values()) == len(bad)
    ids = {p["row"]: p["prompt_id"] for b in batches.values() for p in b}
    assert ids[0] == "p0" and ids[7 + sum(1 for r in bad if r < 7)] == str(7 + sum(1 for r in bad if r < 7))
    info = json.loads((run / "run.json").read_text())
    assert set(info["fingerprints"]) == {"config", "corpus", "tokenizer", "model", "weights"}


def test_replan_is_byte_identical_and_changed_config_is_refused(tiny_model, tmp_path, ray_local):
    write_corpus(tmp_path / "c.jsonl", num_good=80, seed=1)
    a, b = tmp_path / "a", tmp_path / "b"
    plan(config(tiny_model, tmp_path / "c.jsonl", a))
    plan(config(tiny_model, tmp_path / "c.jsonl", b, "--corpus.shard_bytes=300"))  # sharding does not change the plan
    for name in ["batches.jsonl", "rejected.jsonl"] + [f"batches/{p.name}" for p in (a / "batches").iterdir()]:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert sorted(p.name for p in (a / "batches").iterdir()) == sorted(p.name for p in (b / "batches").iterdir())

    assert plan(config(tiny_model, tmp_path / "c.jsonl", a)).already_planned
    with pytest.raises(PlanMismatch, match=r"sampling.n: 1 -> 2(.|\n)*--name"):
        plan(config(tiny_model, tmp_path / "c.jsonl", a, "--sampling.n=2"))
    with open(tmp_path / "c.jsonl", "a") as f:
        f.write('{"prompt": "one more"}\n')
    with pytest.raises(PlanMismatch, match="corpus changed"):
        plan(config(tiny_model, tmp_path / "c.jsonl", a))


def test_one_head_per_run_dir(tiny_model, tmp_path, ray_local):
    write_corpus(tmp_path / "c.jsonl", num_good=5)
    with RunLock(tmp_path / "run"):
        with pytest.raises(RunDirLocked, match="in use by .*pid"):
            plan(config(tiny_model, tmp_path / "c.jsonl", tmp_path / "run"))
    assert not plan(config(tiny_model, tmp_path / "c.jsonl", tmp_path / "run")).already_planned


def test_parquet_directory_through_a_url(tiny_model, tmp_path, ray_local):
    import pyarrow as pa

    data = tmp_path / "data"
    data.mkdir()
    pq.write_table(pa.table({"id": [f"q{i}" for i in range(30)], "prompt": ["hello world " * (i % 5 + 1) for i in range(30)]}),
                   data / "part-0.parquet", row_group_size=7)
    (data / "part-1.jsonl").write_text('{"id": "j0", "messages": [{"role": "user", "content": "hi"}]}\n')
    result = plan(config(tiny_model, f"file://{data}", tmp_path / "run"))
    assert (result.stats.rows_read, result.stats.accepted) == (31, 31)
    rows = sorted(p["row"] for b in read_batches(tmp_path / "run").values() for p in b)
    assert rows == list(range(31))


# -- runs that can produce nothing: refused in one line, exit FAULT, no traceback ---------------------------------


def _one_line_fault(capsys, args: list[str]) -> str:
    from orchestrator.commands.cli import main
    from orchestrator.exit_codes import FAULT

    assert main(args) == FAULT
    err = capsys.readouterr().err.strip()
    assert err and "\n" not in err and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("command", ["plan", "run"])
def test_a_config_no_prompt_fits_is_refused_up_front(tiny_model, tmp_path, capsys, command):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"id": "a", "prompt": "hello world"}\n')
    run_dir = tmp_path / "run"
    err = _one_line_fault(capsys, [command, str(DEMO), f"--model.path={tiny_model}", f"--corpus.path={corpus}",
                                   f"--run_dir={run_dir}", "--tracker.type=noop", "--sampling.max_new_tokens=100000"])
    assert "sampling.max_new_tokens" in err and "no prompt can fit" in err
    assert not run_dir.exists()  # refused before anything was made (and before Ray started)


@pytest.mark.parametrize("command", ["plan", "run"])
def test_an_empty_corpus_is_refused_in_one_line(tiny_model, tmp_path, capsys, command):
    corpus = tmp_path / "empty.jsonl"
    corpus.write_text("")
    run_dir = tmp_path / "run"
    err = _one_line_fault(capsys, [command, str(DEMO), f"--model.path={tiny_model}", f"--corpus.path={corpus}",
                                   f"--run_dir={run_dir}", "--tracker.type=noop"])
    assert "empty" in err and "corpus.path" in err
    assert not run_dir.exists()


def test_a_corpus_of_blank_lines_is_refused_in_one_line(tiny_model, tmp_path, capsys, ray_local):
    corpus = tmp_path / "blank.jsonl"
    corpus.write_text("\n\n  \n")
    run_dir = tmp_path / "run"
    err = _one_line_fault(capsys, ["plan", str(DEMO), f"--model.path={tiny_model}", f"--corpus.path={corpus}",
                                   f"--run_dir={run_dir}"])
    assert "no rows" in err
    assert not (run_dir / "batches.jsonl").exists()


@pytest.mark.parametrize("command", ["plan", "run"])
def test_a_corpus_with_every_row_rejected_exits_fault(run_model, tmp_path, capsys, ray_local, command):
    """A whole checkpoint (`run` reads its safetensors headers before planning), every corpus row bad."""
    corpus = tmp_path / "bad.jsonl"
    corpus.write_bytes(b"{not json\n" + b'{"id": "w", "prompt": 7}\n' + b'{"id": "e", "prompt": ""}\n')
    run_dir = tmp_path / "run"
    args = [command, str(DEMO), f"--model.path={run_model}", f"--corpus.path={corpus}", f"--run_dir={run_dir}",
            "--tracker.type=noop"]
    err = _one_line_fault(capsys, args)
    assert "all 3 rows were rejected" in err and "rejected.jsonl" in err
    assert len((run_dir / "rejected.jsonl").read_text().splitlines()) == 3  # recorded for the user
    assert not (run_dir / "batches.jsonl").exists()  # no plan: a fixed corpus plans afresh
    assert _one_line_fault(capsys, args) == err  # and again, not "nothing to compute", exit 0


def test_a_plan_prints_no_ray_noise(tiny_model, tmp_path):
    """Ray's routine notices (an E-level core_worker line about actor arguments, "Progress bars disabled",
    a line per dataset: Ray Data's, which planned on the cluster before) read as faults; a plan's stderr holds none."""
    import os
    import subprocess
    import sys

    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(f'{{"id": "p{i}", "prompt": "hello world {i}"}}\n' for i in range(6)))
    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "PYTHONPATH": str(root), "JAX_PLATFORMS": "cpu", "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    done = subprocess.run([sys.executable, "-m", "orchestrator", "plan", str(DEMO), f"--model.path={tiny_model}",
                           f"--corpus.path={corpus}", f"--run_dir={tmp_path / 'run'}",
                           "--corpus.in_process_bytes=0"],  # on the cluster, where the noise comes from
                          env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    for noise in ("core_worker.cc", "Progress bars disabled", "execution finished", "Warning"):
        assert noise not in done.stderr, done.stderr[-3000:]


def test_prompts_behind_a_shared_block_plan_together_and_the_report_counts_them(tiny_model, tmp_path, ray_local):
    """Half the prompts start with the same long block: the capacity report counts their shared full pages,
    and they run in consecutive batches (batches still sized as if nothing were shared)."""
    import transformers

    rng = np.random.default_rng(0)
    words = ["the", "quick", "brown", "fox", "sea", "poem", "hello", "world"]
    block = "Instructions: " + " ".join(rng.choice(words, 50)) + ".\n"
    rows = []
    for i in range(48):
        question = " ".join(rng.choice(words, int(rng.integers(2, 12))))
        rows.append({"id": f"q{i}", "prompt": (block if i % 2 == 0 else "") + question})
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = config(tiny_model, tmp_path / "c.jsonl", tmp_path / "run")
    result = plan(cfg)
    tok = transformers.AutoTokenizer.from_pretrained(tiny_model)
    ids = [tok(r["prompt"])["input_ids"] for r in rows]
    common = min(next((k for k, (a, b) in enumerate(zip(ids[0], x)) if a != b), len(x)) for x in ids[2::2])
    shared_pages = (common - 1) // 16 if common else 0
    assert shared_pages >= 2, "the block must cover full pages for the test to mean anything"
    assert result.stats.shareable_prompt_tokens >= 16 * shared_pages * 23
    assert f"shareable      {result.stats.shareable_prompt_tokens:>12,}" in result.stats.format()
    records = read_manifest(tmp_path / "run" / "batches.jsonl")
    batches = read_batches(tmp_path / "run")
    holding = [b for b, r in enumerate(records) if any(p["prompt_id"] in {f"q{i}" for i in range(0, 48, 2)}
                                                       for p in batches[r.batch_id])]
    assert holding == list(range(holding[0], holding[0] + len(holding)))
    limits = PackingLimits.resolve(cfg.packing, cfg.engine, cfg.sampling)
    for r in records:
        assert r.num_pages == limits.page_need(np.array([len(p["token_ids"]) for p in batches[r.batch_id]])).sum()


def test_a_corpus_whose_rows_all_miss_the_text_field_names_corpus_text_field(run_model, tmp_path, capsys, ray_local):
    corpus = tmp_path / "other-names.jsonl"
    corpus.write_bytes(b'{"id": "a", "text": "hi"}\n{"id": "b", "text": "there"}\n')
    err = _one_line_fault(capsys, ["plan", str(DEMO), f"--model.path={run_model}", f"--corpus.path={corpus}",
                                   f"--run_dir={tmp_path / 'run'}", "--tracker.type=noop"])
    assert "all 2 rows were rejected (2 missing_field)" in err
    assert "corpus.text_field='prompt'" in err and "set --corpus.text_field=FIELD" in err
    assert "corpus.messages_field='messages' or corpus.token_ids_field='prompt_token_ids'" in err
