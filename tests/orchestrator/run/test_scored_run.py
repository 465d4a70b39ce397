"""`pagefleet run` over a corpus mixing sampled and scored rows: the scored rows' records are `pagefleet generate`'s,
bit for bit; a resume neither loses nor duplicates them, a recomputed batch gives them again, a re-pack for fewer
slots keeps each continuation once, export keeps them in corpus order, and a bad continuation is a rejected row."""

import json

import pytest

from orchestrator.commands.generate import main as generate_main
from orchestrator.config import load_run_config
from orchestrator.export.export import collect
from orchestrator.plan.planner import plan
from orchestrator.run.driver import Driver
from orchestrator.state.manifest import read_manifest

from ..conftest import run_args

pytestmark = pytest.mark.ray

SCORED = [
    {"id": "mc", "prompt": "Question: is the sea blue?\nAnswer:", "continuation": [" yes", " no", " the sea is", " 4"]},
    {"id": "text", "prompt": "the quick brown fox ", "continuation": "jumps over the lazy dog"},
    {"id": "ids", "prompt": "hello world", "continuation_token_ids": [5, 6, 7, 8, 9]},
    {"id": "lists", "prompt": "write a poem", "continuation_token_ids": [[40, 41], [42], [43, 44, 45]]},
    {"id": "chat", "messages": [{"role": "user", "content": "hello"}], "continuation": [" world", " sea"]},
]
SAMPLED = [{"id": f"s{i}", "prompt": " ".join("the quick brown fox jumps over a lazy dog".split()[: 2 + i])}
           for i in range(7)]
ENGINE = {"max_seq_len": 128, "page_size": 8, "max_pages": 96, "max_seqs": 8, "max_seqs_in_prefill": 4,
          "max_prefill_size": 128}
KEYS = ("prompt_id", "generation_index", "token_ids", "num_prompt_tokens", "continuation_logprobs",
        "continuation_logprob", "is_greedy", "completion", "finish_reason", "error")


def test_scored_rows_in_a_run_equal_generate_and_survive_a_resume(ray_local, run_model, tmp_path):
    rows = [r for pair in zip(SAMPLED, SCORED) for r in pair] + SAMPLED[len(SCORED):]
    rows.append({"id": "bad", "prompt": "hi", "continuation": [""]})
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_dir = tmp_path / "run"
    cfg = load_run_config(None, run_args(run_model, str(corpus), run_dir, "--sampling.temperature=0.8",
                                         "--cluster.num_slices=1"))
    assert Driver(cfg, show_progress=False).run().exit_code == 0
    [rejected] = map(json.loads, (run_dir / "rejected.jsonl").read_text().splitlines())
    assert (rejected["prompt_id"], rejected["reason"]) == ("bad", "bad_continuation")
    assert "empty text" in rejected["detail"]
    manifest = read_manifest(run_dir / "batches.jsonl")
    assert len(manifest) > 1 and any(r.expected_samples for r in manifest)  # scored rows packed among the others

    records = collect(run_dir).to_pylist()
    want_keys = [(r["id"], g) for r in rows[:-1]
                 for g in range(len(_continuations(r)) if _continuations(r) else 1)]
    assert [(r["prompt_id"], r["generation_index"]) for r in records] == want_keys  # corpus order, each once

    _assert_generates_scores(records, run_model, tmp_path)
    sampled = [r for r in records if r["continuation_logprobs"] is None]
    assert len(sampled) == len(SAMPLED) and all(r["token_ids"] and r["is_greedy"] is None for r in sampled)

    # A resume finds every batch done; a batch with scored rows whose output is lost is computed again, the same.
    assert Driver(cfg, show_progress=False).run().exit_code == 0
    assert collect(run_dir).to_pylist() == records
    lost = next(r for r in manifest if r.expected_samples)
    (run_dir / "outputs" / f"{lost.batch_id}.parquet").unlink()
    assert Driver(cfg, show_progress=False).run().exit_code == 0
    assert "was done but" in (run_dir / "events.log").read_text()
    again = collect(run_dir).to_pylist()
    assert [{k: r.get(k) for k in KEYS} for r in again] == [{k: r.get(k) for k in KEYS} for r in records]


def test_a_planned_run_resumed_with_fewer_slots_repacks_scored_rows_exactly_once(ray_local, run_model, tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(r) + "\n" for r in SCORED + SAMPLED))
    run_dir = tmp_path / "run"
    plan(load_run_config(None, run_args(run_model, str(corpus), run_dir, "--cluster.num_slices=1")))
    assert any(r.samples(1) > 4 for r in read_manifest(run_dir / "batches.jsonl"))  # a batch of more than 4 sequences
    retuned = load_run_config(None, run_args(run_model, str(corpus), run_dir, "--cluster.num_slices=1",
                                             "--engine.max_seqs=4"))
    assert Driver(retuned, show_progress=False).run().exit_code == 0
    manifest = read_manifest(run_dir / "batches.jsonl")
    assert all(r.batch_id.endswith("-r1") and r.samples(1) <= 4 for r in manifest)  # one sequence a continuation
    assert any(r.expected_samples for r in manifest)
    records = collect(run_dir).to_pylist()
    assert [(r["prompt_id"], r["generation_index"]) for r in records] == [
        (r["id"], g) for r in SCORED + SAMPLED for g in range(max(1, len(_continuations(r))))]
    _assert_generates_scores(records, run_model, tmp_path)


def _assert_generates_scores(records: list[dict], run_model: str, tmp_path) -> None:
    """The scored records of a run are `pagefleet generate`'s for the same rows, bit for bit."""
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in SCORED))
    assert generate_main(["--model", run_model, "--input", str(tmp_path / "in.jsonl"), "--output",
                          str(tmp_path / "out.jsonl"), "--progress=false", "--dtype=float32",
                          *(f"--engine.{k}={v}" for k, v in ENGINE.items())]) == 0
    generated = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    scored = [r for r in records if r["continuation_logprobs"] is not None]
    assert len(scored) == len(generated) == sum(len(_continuations(r)) for r in SCORED)
    for mine, theirs in zip(scored, generated):
        assert {k: mine.get(k) for k in KEYS} == {k: theirs.get(k) for k in KEYS}  # floats compared exactly
        assert json.loads(mine["passthrough"]).get("continuation") == theirs.get("continuation")


def _continuations(row: dict) -> list:
    value = row.get("continuation", row.get("continuation_token_ids"))
    if value is None:
        return []
    if isinstance(value, str) or (value and isinstance(value[0], int)):
        return [value]
    return value
