"""engine/tokenizer/tokenizer_cache.py: a remembered tokenizer class gives the tokenizer AutoTokenizer gives."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import transformers

from engine.device import compile_cache

from engine.tokenizer import tokenizer_cache
from engine.models.presets import write_model

TEXT = "Hello, world! Ünïcödé  spaces\tand\nnew lines <|end|> 12345"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there?"}]


@pytest.fixture
def memo_dir(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setattr(compile_cache, "directory", lambda: str(cache))
    return cache / "tokenizers"


def behaviour(tok) -> dict:
    ids = tok(TEXT)["input_ids"]
    return {"class": type(tok), "eos": tok.eos_token_id, "bos": tok.bos_token_id, "ids": ids,
            "decode": tok.decode(ids + [0, 1, 2, 3, 4, 5], skip_special_tokens=False),
            "chat": tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)}


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-mistral", "tiny-qwen2"])
def test_second_load_skips_autotokenizer_and_behaves_the_same(preset, tmp_path, memo_dir, monkeypatch):
    model = write_model(preset, tmp_path / preset, seed=0)
    first = tokenizer_cache.load_tokenizer(model)
    assert behaviour(first) == behaviour(transformers.AutoTokenizer.from_pretrained(model))
    assert len(list(memo_dir.glob("*.json"))) == 1

    def no_auto(*args, **kwargs):
        raise AssertionError("AutoTokenizer was called although the class was remembered")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", no_auto)
    assert behaviour(tokenizer_cache.load_tokenizer(model)) == behaviour(first)


def test_changed_tokenizer_files_decide_again(tmp_path, memo_dir, monkeypatch):
    model = write_model("tiny-llama", tmp_path / "m", seed=0)
    tokenizer_cache.load_tokenizer(model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["model_max_length"] = 123
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    calls = []
    original = transformers.AutoTokenizer.from_pretrained
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: calls.append(a) or original(*a, **k))
    assert tokenizer_cache.load_tokenizer(model).model_max_length == 123
    assert len(calls) == 1 and len(list(memo_dir.glob("*.json"))) == 2


def test_unusable_memo_falls_back_to_autotokenizer(tmp_path, memo_dir):
    model = write_model("tiny-qwen2", tmp_path / "m", seed=0)
    tokenizer_cache.load_tokenizer(model)
    (memo,) = memo_dir.glob("*.json")
    memo.write_text(json.dumps({"module": "transformers.no_such_module", "name": "Nope"}))
    tok = tokenizer_cache.load_tokenizer(model)
    assert behaviour(tok) == behaviour(transformers.AutoTokenizer.from_pretrained(model))
    assert json.loads(memo.read_text())["name"] == type(tok).__qualname__  # rewritten


def test_no_memo_when_the_cache_is_off(tmp_path, monkeypatch):
    monkeypatch.setattr(compile_cache, "directory", lambda: None)
    model = write_model("tiny-llama", tmp_path / "m", seed=0)
    assert tokenizer_cache.load_tokenizer(model).eos_token_id is not None
    assert not any(p.name == "tokenizers" for p in tmp_path.rglob("*"))


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-mistral", "tiny-qwen2"])
def test_text_decoder_decodes_as_the_tokenizer_does(preset, tmp_path):
    """The stop checker's decoder: the Rust tokenizer's decode called directly where transformers' decode is
    only that, the same text for any ids (special tokens, byte pieces cut mid-character); a class that
    decodes its own way keeps its own decode."""
    import numpy as np

    tok = tokenizer_cache.load_tokenizer(write_model(preset, tmp_path / preset, seed=0))
    decode = tokenizer_cache.text_decoder(tok)
    rng = np.random.default_rng(0)
    for _ in range(500):
        ids = rng.integers(0, len(tok), int(rng.integers(0, 12))).tolist()
        assert decode(ids) == tok.decode(ids, skip_special_tokens=False)
    ids = tok(TEXT)["input_ids"]
    assert decode(ids) == tok.decode(ids, skip_special_tokens=False)

    tok.decode = lambda *args, **kwargs: pytest.fail("transformers' decode was called")
    decode(ids)  # the direct path: transformers' Python is not in the way

    class OwnDecode(type(tok)):
        def _decode(self, token_ids, **kwargs):
            return "own"

    tok.__class__ = OwnDecode
    del tok.decode
    assert tokenizer_cache.text_decoder(tok)(ids) == "own"
    tok.__class__ = OwnDecode.__mro__[1]
    tok.clean_up_tokenization_spaces = True  # transformers' decode would clean up spaces: it stays in the way
    tok.decode = lambda *args, **kwargs: "via transformers"
    assert tokenizer_cache.text_decoder(tok)(ids) == "via transformers"


_WITHOUT_TORCH = r"""
import json, sys
from orchestrator.commands.cli import hide_torch
assert hide_torch()
from engine.tokenizer.tokenizer_cache import load_tokenizer
from tests.engine.tokenizer.test_tokenizer_cache import behaviour
out = {}
for path in sys.argv[1:]:
    b = behaviour(load_tokenizer(path))
    out[path] = {**b, "class": b["class"].__module__ + "." + b["class"].__qualname__}
loaded = sorted(m for m, v in sys.modules.items() if v is not None and (m == "torch" or m.startswith("torch.")))
print(json.dumps({"tokenizers": out, "torch_modules": loaded}))
"""


def test_the_command_line_decides_each_tokenizer_as_with_torch_without_importing_it(tmp_path):
    """`pagefleet` hides torch from transformers (3 s of imports for nothing): the tokenizer AutoTokenizer
    picks and how it tokenizes must be the ones it picks with torch installed, for every family."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    models = [str(write_model(p, tmp_path / p, seed=0)) for p in ("tiny-llama", "tiny-mistral", "tiny-qwen2")]
    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "PYTHONPATH": str(root), "PAGEFLEET_COMPILE_CACHE": "off"}  # no memo: AutoTokenizer decides
    env.pop("PAGEFLEET_ALLOW_TORCH", None)
    proc = subprocess.run([sys.executable, "-c", _WITHOUT_TORCH, *models], capture_output=True, text=True, env=env,
                          cwd=root, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "PyTorch was not found" not in proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["torch_modules"] == []
    for model in models:
        with_torch = behaviour(transformers.AutoTokenizer.from_pretrained(model))
        with_torch["class"] = with_torch["class"].__module__ + "." + with_torch["class"].__qualname__
        assert result["tokenizers"][model] == with_torch



def test_threads_loading_at_once_in_a_fresh_process_all_get_the_tokenizer(tmp_path):
    """The service runs each run's head in a thread of one process, so two runs submitted together load their
    tokenizers at once. transformers' lazy module is not safe for that: a first `transformers.AutoTokenizer` in
    two threads at once raises AttributeError in one of them (a failed run)."""
    model = write_model("tiny-llama", tmp_path / "m", seed=0)
    script = f"""
import json, threading
from engine.tokenizer import tokenizer_cache
got = []
def load():
    try:
        got.append(type(tokenizer_cache.load_tokenizer({str(model)!r})).__name__)
    except Exception as e:
        got.append(repr(e))
threads = [threading.Thread(target=load) for _ in range(4)]
[t.start() for t in threads]
[t.join() for t in threads]
print(json.dumps(got))
"""
    env = {**os.environ, compile_cache.ENV: "off"}  # no memo: every thread goes through AutoTokenizer
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(got) == 4 and len(set(got)) == 1 and "Error" not in got[0], got
