"""`pagefleet plan` with the Llama-3.1-8B deployment configs, on a directory without weights."""

import json
from pathlib import Path

import pytest

from engine.tokenizer.tokenizer_builder import write_tokenizer
from orchestrator.config import load_run_config
from orchestrator.state.manifest import read_manifest
from orchestrator.plan.planner import plan
from tests.orchestrator.plan.llama31_8b import write_llama31_8b_config

ROOT = Path(__file__).resolve().parents[3]
CONFIGS = ["configs/llama3.1-8b-v5p-16.yaml", "configs/llama3.1-8b-v6e-8.yaml"]


@pytest.fixture(scope="module")
def llama_without_weights(tmp_path_factory) -> Path:
    """config.json of Llama-3.1-8B and a small in-process tokenizer (ids < 128256): all planning reads."""
    model = write_llama31_8b_config(tmp_path_factory.mktemp("llama-3.1-8b"))
    write_tokenizer(model, vocab_size=1024, model_max_length=131072)
    assert not list(model.glob("*.safetensors"))
    return model


@pytest.mark.ray
@pytest.mark.parametrize("config", CONFIGS)
def test_deployment_config_plans_without_weights(config, llama_without_weights, tmp_path, ray_local):
    corpus = tmp_path / "prompts.jsonl"
    rows = [{"id": f"p{i}", "prompt": "Explain step by step: " + "why the sea is blue " * (1 + i % 7)} for i in range(30)]
    rows.append({"id": "chat", "messages": [{"role": "user", "content": "Write a poem about pages."}]})
    rows.append({"id": "long", "prompt": "word " * 5000})  # beyond engine.max_seq_len 3072 with 1024 new tokens
    corpus.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_run_config(ROOT / config, [f"--model.path={llama_without_weights}", f"--corpus.path={corpus}",
                                          f"--run_dir={tmp_path / 'run'}"])
    result = plan(cfg)
    assert (result.stats.rows_read, result.stats.accepted) == (32, 31)
    rejected = [json.loads(line) for line in (tmp_path / "run" / "rejected.jsonl").read_text().splitlines()]
    assert [(r["prompt_id"], r["reason"]) for r in rejected] == [("long", "too_long")]
    records = read_manifest(tmp_path / "run" / "batches.jsonl")
    assert sum(r.num_prompts for r in records) == 31
    assert all(r.num_pages <= cfg.engine.max_pages for r in records)
