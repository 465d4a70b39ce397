"""`pagefleet generate` as a user runs it: a subprocess on a model written by `init-model`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import transformers

from engine.presets import write_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model("tiny-llama", tmp_path_factory.mktemp("m"))


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-m", "orchestrator", *args], capture_output=True, text=True, env=env,
                          timeout=600)


def test_generate_writes_one_record_per_sample_in_input_order(tmp_path, model_dir):
    rows = ['{"id": "a", "prompt": "Hello there"}', '{"id": "b", "messages": [{"role": "user", "content": "hi"}]}',
            'not json', '{"id": "c", "prompt_token_ids": [5, 6, 7]}', '{"id": "d", "prompt": ""}',
            '{"id": "a", "prompt": "same id again"}']
    (tmp_path / "in.jsonl").write_text("\n".join(rows) + "\n")
    out = tmp_path / "out.jsonl"
    proc = run_cli("generate", "--model", str(model_dir), "--input", str(tmp_path / "in.jsonl"), "--output", str(out),
                   "--sampling.max_new_tokens=6", "--sampling.n=2", "--sampling.temperature=0.7",
                   "--sampling.logprobs=true", "--engine.max_seq_len=256", "--engine.max_pages=32", "--progress=false")
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["prompt_id"], r["generation_index"]) for r in records] == [
        (p, g) for p in ["a", "b", "line-3", "c", "d", "line-6"] for g in (0, 1)]
    by = {(r["prompt_id"], r["generation_index"]): r for r in records}
    assert by[("line-6", 0)]["error"] == "duplicate id 'a' (first on line 1)"
    assert "malformed JSON" in by[("line-3", 0)]["error"] and by[("d", 1)]["error"].startswith("empty prompt")
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert by[("b", 0)]["num_prompt_tokens"] == len(tok(chat, add_special_tokens=False)["input_ids"])
    for key in [("a", 0), ("a", 1), ("b", 0), ("c", 1)]:
        r = by[key]
        assert r["finish_reason"] in ("stop", "length") and 1 <= len(r["token_ids"]) <= 6
        assert len(r["logprobs"]) == len(r["token_ids"]) and all(lp <= 0 for lp in r["logprobs"])
    assert by[("a", 0)]["token_ids"] != by[("a", 1)]["token_ids"]  # two samples, two random streams


def test_generate_refuses_unknown_keys_and_tiny_capacity(tmp_path, model_dir):
    (tmp_path / "in.jsonl").write_text('{"id": "a", "prompt": "x"}\n')
    args = ["generate", "--model", str(model_dir), "--input", str(tmp_path / "in.jsonl"), "--output",
            str(tmp_path / "o.jsonl")]
    proc = run_cli(*args, "--sampling.max_new_tokenz=3")
    assert proc.returncode != 0 and "max_new_tokenz" in proc.stderr
    proc = run_cli(*args, "--engine.max_pages=2")
    assert proc.returncode != 0 and "engine.max_pages=2" in proc.stderr
    assert not (tmp_path / "o.jsonl").exists()
