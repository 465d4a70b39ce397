"""The ids that end a sample: generation_config.json's eos_token_id where the checkpoint has one, else config.json's,
plus the tokenizer's EOS (as transformers' `generate` and vLLM read them)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from engine import Engine, EngineConfig, ModelConfig, Request, SamplingConfig, UnsupportedModelError, write_model
from orchestrator.plan.model_source import ModelSourceConfig, model_fingerprint
from tests.engine.models.hf_reference import hf_greedy, make_hf_model


def _write(path: Path, **fields) -> None:
    path.write_text(json.dumps(fields))


def test_generation_config_names_the_eos_ids_else_config_json(tmp_path):
    write_model("tiny-llama", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    eos = config["eos_token_id"]
    source = ModelSourceConfig(path=str(tmp_path))
    fingerprint = model_fingerprint(source)
    assert ModelConfig.from_pretrained(tmp_path).eos_token_ids == (eos,)  # the preset writes the same id in both

    _write(tmp_path / "generation_config.json", eos_token_id=[eos, 7], temperature=0.6)
    assert ModelConfig.from_pretrained(tmp_path).eos_token_ids == (eos, 7)
    assert model_fingerprint(source) != fingerprint  # samples end elsewhere: a planned run must not resume
    _write(tmp_path / "generation_config.json", eos_token_id=[eos])
    assert model_fingerprint(source) == fingerprint  # the same ids as config.json: a run planned before resumes
    _write(tmp_path / "generation_config.json", do_sample=True)
    assert ModelConfig.from_pretrained(tmp_path).eos_token_ids == ()  # the file wins, as in transformers and vLLM
    (tmp_path / "generation_config.json").unlink()
    _write(tmp_path / "config.json", **{**config, "eos_token_id": [eos, 9]})
    assert ModelConfig.from_pretrained(tmp_path).eos_token_ids == (eos, 9)


@pytest.mark.parametrize("text, message", [
    ("{", "generation_config.json is not valid JSON"),
    (b'{"eos_token_id": "\xff"}', "generation_config.json is not valid JSON"),
    ("[1, 2]", "generation_config.json holds a JSON list, not an object"),
    ('{"eos_token_id": "2"}', "generation_config.json eos_token_id='2': must be a token id or a list of token ids"),
    ('{"eos_token_id": [2, -1]}', r"generation_config.json eos_token_id=\[2, -1\]"),
])
def test_a_bad_generation_config_is_refused_in_one_line(tmp_path, text, message):
    write_model("tiny-llama", tmp_path)
    path = tmp_path / "generation_config.json"
    path.write_bytes(text) if isinstance(text, bytes) else path.write_text(text)
    with pytest.raises(UnsupportedModelError, match=message) as raised:
        ModelConfig.from_pretrained(tmp_path)
    assert "\n" not in str(raised.value)


def test_a_sample_ends_at_an_eos_id_only_generation_config_names_as_in_transformers(tmp_path):
    """An instruct checkpoint names its end-of-turn token in generation_config.json alone (Gemma 2's, Qwen's
    `<|endoftext|>`): the sample ends there, token for token as transformers' `generate` ends it."""
    prompt = [11, 40, 7, 93, 12, 150]
    free, gap = hf_greedy(make_hf_model("llama3", tmp_path, seed=3), prompt, 24)
    assert gap > 1e-3 and 2 not in free  # config.json's EOS never comes; the argmax is clear at every step
    cut = next(i for i, t in enumerate(free) if i >= 3 and t not in free[:i])
    _write(tmp_path / "generation_config.json", bos_token_id=1, eos_token_id=[2, free[cut]])

    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    expected = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                           do_sample=False, max_new_tokens=24, pad_token_id=0)[0, len(prompt):].tolist()
    assert expected == free[:cut + 1]  # transformers ends it there
    engine = Engine(tmp_path, EngineConfig(page_size=8, max_pages=16, max_seqs=2, max_seq_len=64))
    [record] = engine.generate([Request("p", tuple(prompt), SamplingConfig(max_new_tokens=24, temperature=0.0))])
    assert record.token_ids == expected and record.finish_reason == "stop"
