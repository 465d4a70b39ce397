"""`pagefleet run` with structured outputs: a corpus whose rows carry their own response_format (several schemas,
json_object, text) samples completions that parse; a row whose response_format cannot be used is a rejected row
with the reason; a run-wide schema that does not compile is one line at the head before any slice."""

import json

import jsonschema
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from orchestrator import exit_codes
from orchestrator.commands.cli import main
from orchestrator.config import load_run_config
from orchestrator.run.driver import Driver

from ..conftest import run_args, write_run_corpus

pytestmark = pytest.mark.ray

LABEL = {"type": "object", "properties": {"label": {"enum": ["spam", "ham"]},
                                          "score": {"type": "integer", "minimum": 1, "maximum": 5},
                                          "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}},
         "required": ["label", "score", "flags"], "additionalProperties": False}
YES_NO = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
          "additionalProperties": False}


def _rf(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}


def test_a_corpus_mixing_per_row_schemas(ray_local, run_model, tmp_path):
    rows, schemas = [], {}
    words = "label this message please it is short".split()
    for i in range(12):
        schema, rf = [(LABEL, _rf(LABEL)), (YES_NO, _rf(YES_NO)), (None, {"type": "text"})][i % 3]
        rows.append({"id": f"r{i}", "prompt": " ".join(words[: 2 + i % 5]), "response_format": rf})
        schemas[f"r{i}"] = schema
    rows.append({"id": "xml", "prompt": "hi", "response_format": {"type": "xml"}})
    rows.append({"id": "broken", "prompt": "hi", "response_format": _rf({"type": "nonsense"})})
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_dir = tmp_path / "run"
    cfg = load_run_config(None, run_args(run_model, str(corpus), run_dir, "--corpus.response_format_field=response_format",
                                         "--sampling.max_new_tokens=100", "--sampling.temperature=0.8",
                                         "--cluster.num_slices=1"))
    assert Driver(cfg, show_progress=False).run().exit_code == 0
    rejected = {r["prompt_id"]: r for r in map(json.loads, (run_dir / "rejected.jsonl").read_text().splitlines())}
    assert rejected["xml"]["reason"] == "bad_response_format"
    assert "type 'xml' is not one of json_schema, json_object, text" in rejected["xml"]["detail"]
    assert rejected["broken"]["reason"] == "invalid_grammar"
    assert "nonsense" in rejected["broken"]["detail"] and "\n" not in rejected["broken"]["detail"]
    records = pa.concat_tables([pq.read_table(p) for p in sorted((run_dir / "outputs").glob("*.parquet"))]).to_pylist()
    assert sorted(r["prompt_id"] for r in records) == sorted(schemas)
    stopped = 0
    for r in records:
        schema = schemas[r["prompt_id"]]
        if schema is not None and r["finish_reason"] == "stop":
            jsonschema.validate(json.loads(r["completion"]), schema)
            stopped += 1
    assert stopped == 8  # both schemas are of bounded length: every constrained row ends within 100 tokens


def test_a_run_wide_schema_that_does_not_compile_is_one_line_before_any_slice(run_model, tmp_path, capsys):
    corpus = write_run_corpus(tmp_path / "corpus.jsonl", 4)
    run_dir = tmp_path / "run"
    config = tmp_path / "run.yaml"
    config.write_text("name: test\n")
    code = main(["run", str(config), *run_args(run_model, corpus, run_dir, "--cluster.num_slices=1",
                                               '--sampling.json_schema={"type": "integer", "minimum": 5, "maximum": 1}')])
    err = capsys.readouterr().err.strip()
    assert code != exit_codes.OK and "sampling.json_schema" in err and "minimum" in err and "\n" not in err, err
    assert not (run_dir / "events.log").exists()


def test_a_run_wide_schema_from_yaml_runs_and_resumes(ray_local, run_model, tmp_path):
    """The run config's own schema (a YAML mapping) reaches every prompt; the run directory's plan holds it, so a
    second run of the same config finds every batch done."""
    corpus = write_run_corpus(tmp_path / "corpus.jsonl", 6)
    run_dir = tmp_path / "run"
    config = tmp_path / "run.yaml"
    config.write_text("name: yaml-schema\nsampling:\n  json_schema:\n    type: object\n    properties:\n"
                      "      ok: {type: boolean}\n    required: [ok]\n    additionalProperties: false\n")
    args = run_args(run_model, corpus, run_dir, "--cluster.num_slices=1", "--sampling.max_new_tokens=40")
    cfg = load_run_config(str(config), args)
    assert Driver(cfg, show_progress=False).run().exit_code == 0
    records = pa.concat_tables([pq.read_table(p) for p in sorted((run_dir / "outputs").glob("*.parquet"))]).to_pylist()
    assert len(records) == 6
    for r in records:
        assert r["finish_reason"] == "stop" and json.loads(r["completion"]) in ({"ok": True}, {"ok": False})
    stamps = {p.name: p.stat().st_mtime_ns for p in (run_dir / "outputs").iterdir()}
    assert Driver(load_run_config(str(config), args), show_progress=False).run().exit_code == 0
    assert {p.name: p.stat().st_mtime_ns for p in (run_dir / "outputs").iterdir()} == stamps
