"""`pagefleet generate` and `pagefleet.generate` with structured outputs: run-wide keys from the command line (a
JSON Schema as JSON text, a regex, choices), a line's own `response_format`, and the one-line errors."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

import pagefleet
from engine.models.presets import write_model
from orchestrator import exit_codes
from orchestrator.commands.generate import main as generate_main

SCHEMA = {"type": "object", "properties": {"kind": {"enum": ["a", "b"]},
                                           "n": {"type": "integer", "minimum": -3, "maximum": 300},
                                           "xs": {"type": "array", "items": {"enum": [1, 2]}, "maxItems": 2}},
          "required": ["kind", "n", "xs"], "additionalProperties": False}
FLAGS = ["--sampling.max_new_tokens=60", "--engine.max_seq_len=128", "--engine.max_pages=64", "--progress=false"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model("tiny-llama", tmp_path_factory.mktemp("m"))


def _generate(tmp_path, model_dir, lines: list[dict], *flags: str) -> tuple[int, dict]:
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    out = tmp_path / "out.jsonl"
    code = generate_main(["--model", str(model_dir), "--input", str(tmp_path / "in.jsonl"), "--output", str(out),
                          *FLAGS, *flags])
    records = {} if not out.exists() else {r["prompt_id"]: r for r in map(json.loads, out.read_text().splitlines())}
    return code, records


def test_a_json_schema_from_the_command_line(tmp_path, model_dir):
    lines = [{"id": f"p{i}", "prompt": "hello " * (i + 1)} for i in range(6)]
    code, records = _generate(tmp_path, model_dir, lines, f"--sampling.json_schema={json.dumps(SCHEMA)}",
                              "--sampling.temperature=1.0")
    assert code == exit_codes.OK
    for r in records.values():
        assert r["finish_reason"] == "stop", r
        jsonschema.validate(json.loads(r["completion"]), SCHEMA)


def test_lines_with_their_own_response_format(tmp_path, model_dir):
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}
    lines = [{"id": "schema", "prompt": "hi", "response_format": rf},
             {"id": "object", "prompt": "hi", "response_format": {"type": "json_object"}},
             {"id": "text", "prompt": "hi", "response_format": {"type": "text"}},
             {"id": "own", "prompt": "hi", "sampling": {"choice": ["left", "right"]}},
             {"id": "xml", "prompt": "hi", "response_format": {"type": "xml"}},
             {"id": "broken", "prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {}}},
             {"id": "bad", "prompt": "hi", "response_format": {"type": "json_schema",
                                                               "json_schema": {"schema": {"type": "nonsense"}}}},
             {"id": "two", "prompt": "hi", "sampling": {"regex": "a+"}, "response_format": rf}]
    code, records = _generate(tmp_path, model_dir, lines)
    assert code == exit_codes.OK
    jsonschema.validate(json.loads(records["schema"]["completion"]), SCHEMA)
    if records["object"]["finish_reason"] == "stop":
        assert isinstance(json.loads(records["object"]["completion"]), dict)
    assert records["own"]["completion"] in ("left", "right")
    assert "error" not in records["text"]
    assert records["xml"]["error"] == ("bad_response_format: field 'response_format': type 'xml' is not one of "
                                       "json_schema, json_object, text")
    assert records["broken"]["error"].startswith("bad_response_format: field 'response_format': type json_schema "
                                                 "needs json_schema.schema")
    assert records["bad"]["error"].startswith("invalid_grammar: sampling.json_schema: ")
    assert "nonsense" in records["bad"]["error"]
    assert records["two"]["error"].startswith("bad_response_format: field 'response_format' and the row's "
                                              "sampling.regex both set a structured output")


def test_a_run_wide_grammar_that_does_not_compile_is_one_line(tmp_path, model_dir, capsys):
    code, records = _generate(tmp_path, model_dir, [{"id": "a", "prompt": "hi"}], "--sampling.regex=a(")
    err = capsys.readouterr().err.strip().splitlines()
    assert code == exit_codes.FAULT and records == {}
    assert err[-1].startswith("pagefleet generate: sampling.regex: ") and "unclosed group" in err[-1], err


def test_the_python_api_takes_the_same_keys(model_dir):
    out = pagefleet.generate(str(model_dir), ["one", "two"], engine={"max_pages": 64, "max_seq_len": 128},
                             max_new_tokens=30, regex=r"[0-9]{3}-[a-z]{2}")
    assert all(re.fullmatch(r"[0-9]{3}-[a-z]{2}", r["completion"]) for r in out), out
    with pytest.raises(ValueError, match="sampling.json_schema: "):
        pagefleet.generate(str(model_dir), ["one"], engine={"max_pages": 64, "max_seq_len": 128},
                           json_schema={"type": "nonsense"})
