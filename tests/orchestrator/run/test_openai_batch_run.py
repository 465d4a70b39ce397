"""An OpenAI Batch file of chat requests with mixed parameters runs with `pagefleet run` (corpus.format: openai_batch)
and exports as OpenAI Batch output lines that the `openai` package's own response types read back; custom_ids,
choices and usage equal the run's own records, and the json_schema lines' contents validate."""

import json
import shutil

import jsonschema
import pytest
from openai.types import BatchError, Completion
from openai.types.chat import ChatCompletion

from orchestrator import exit_codes
from orchestrator.commands.cli import main

from ..conftest import run_args

pytestmark = pytest.mark.ray

LABEL = {"type": "object", "properties": {"label": {"enum": ["spam", "ham"]},
                                          "score": {"type": "integer", "minimum": 1, "maximum": 5}},
         "required": ["label", "score"], "additionalProperties": False}


def _line(custom_id: str, body: dict, url: str = "/v1/chat/completions") -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": {"model": "gpt-4o-mini", **body}}


def _chat(text: str) -> list[dict]:
    return [{"role": "system", "content": "be brief"}, {"role": "user", "content": text}]


LINES = [
    _line("greedy", {"messages": _chat("the quick brown fox"), "temperature": 0, "max_tokens": 6}),
    _line("sampled-n2", {"messages": _chat("write a poem about the sea"), "temperature": 0.9, "top_p": 0.95,
                         "n": 2, "seed": 7, "max_completion_tokens": 10}),
    _line("schema", {"messages": _chat("label this message"), "temperature": 0.7, "max_tokens": 60,
                     "response_format": {"type": "json_schema",
                                         "json_schema": {"name": "label", "strict": True, "schema": LABEL}}}),
    _line("object", {"messages": [{"role": "user", "content": [{"type": "text", "text": "any json"}]}],
                     "max_tokens": 30, "response_format": {"type": "json_object"}, "user": "u1"}),
    _line("stopped", {"messages": _chat("hello world"), "stop": "o", "temperature": 1.0, "seed": 3}),
    _line("text", {"prompt": "hello world data", "max_tokens": 5}, url="/v1/completions"),
    _line("tools", {"messages": _chat("hi"), "tools": [{"type": "function", "function": {"name": "f"}}]}),
    _line("xml", {"messages": _chat("hi"), "response_format": {"type": "xml"}}),
    _line("embed", {"input": "hi"}, url="/v1/embeddings"),
]


@pytest.fixture(scope="module")
def batch_run(ray_local, run_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("openai-batch")
    corpus = root / "batch.jsonl"
    corpus.write_text("".join(json.dumps(line) + "\n" for line in LINES[:5]) + '{"custom_id": "broken", "body": \n'
                      + "".join(json.dumps(line) + "\n" for line in LINES[5:]))
    config = root / "run.yaml"
    config.write_text("name: openai-batch\ncorpus:\n  format: openai_batch\n")
    run_dir = root / "run"
    assert main(["run", str(config), *run_args(run_model, str(corpus), run_dir, "--cluster.num_slices=1",
                                               "--sampling.n=2", "--sampling.max_new_tokens=12")]) == exit_codes.OK
    records, batch = root / "records.jsonl", root / "batch_output.jsonl"
    assert main(["export", str(run_dir), "--output", str(records), "--no-progress"]) == exit_codes.OK
    assert main(["export", str(run_dir), "--output", str(batch), "--format", "openai_batch",
                 "--no-progress"]) == exit_codes.OK
    return {"run_dir": run_dir, "records": [json.loads(x) for x in records.read_text().splitlines()],
            "lines": [json.loads(x) for x in batch.read_text().splitlines()]}


def test_the_batch_output_reads_back_with_openai_types_and_matches_the_records(batch_run):
    lines, records = batch_run["lines"], batch_run["records"]
    assert [line["custom_id"] for line in lines] == ["greedy", "sampled-n2", "schema", "object", "stopped", None,
                                                     "text", "tools", "xml", "embed"]  # corpus order, one per line
    assert len({line["id"] for line in lines}) == len(lines)
    by_id = {}
    for r in records:
        by_id.setdefault(r["prompt_id"], []).append(r)
    wanted_n = {"sampled-n2": 2}
    for line in lines[:5] + [lines[6]]:
        assert set(line) == {"id", "custom_id", "response", "error"} and line["error"] is None
        assert line["response"]["status_code"] == 200 and line["response"]["request_id"]
        body = line["response"]["body"]
        own = by_id[line["custom_id"]]
        assert len(own) == 2  # the run samples sampling.n = 2 per row
        kept = own[:wanted_n.get(line["custom_id"], 1)]  # a line's own n: its first samples
        if line["custom_id"] == "text":
            parsed = Completion.model_validate(body)
            assert parsed.object == "text_completion"
            assert [c.text for c in parsed.choices] == [r["completion"] for r in kept]
        else:
            parsed = ChatCompletion.model_validate(body)
            assert parsed.object == "chat.completion"
            assert [c.message.content for c in parsed.choices] == [r["completion"] for r in kept]
            assert all(c.message.role == "assistant" and c.logprobs is None for c in parsed.choices)
        assert [c.index for c in parsed.choices] == [r["generation_index"] for r in kept]
        assert [c.finish_reason for c in parsed.choices] == [r["finish_reason"] for r in kept]
        assert parsed.usage.prompt_tokens == kept[0]["num_prompt_tokens"]
        assert parsed.usage.completion_tokens == sum(len(r["token_ids"]) for r in kept)
        assert parsed.usage.total_tokens == parsed.usage.prompt_tokens + parsed.usage.completion_tokens
    greedy = by_id["greedy"]
    assert greedy[0]["completion"] == greedy[1]["completion"] and len(greedy[0]["token_ids"]) <= 6
    assert len(by_id["sampled-n2"][0]["token_ids"]) <= 10
    schema = ChatCompletion.model_validate(lines[2]["response"]["body"]).choices[0]
    assert schema.finish_reason == "stop"
    jsonschema.validate(json.loads(schema.message.content), LABEL)
    obj = ChatCompletion.model_validate(lines[3]["response"]["body"]).choices[0]
    if obj.finish_reason == "stop":
        assert isinstance(json.loads(obj.message.content), dict)
    assert "o" not in ChatCompletion.model_validate(lines[4]["response"]["body"]).choices[0].message.content


def test_rejected_lines_are_batch_errors_of_one_clear_line(batch_run):
    errors = {line["custom_id"]: line for line in batch_run["lines"] if line["error"] is not None}
    assert set(errors) == {None, "tools", "xml", "embed"}
    for line in errors.values():
        assert line["response"] is None
        error = BatchError.model_validate(line["error"])
        assert error.code and error.message.startswith(f"{error.code}: ") and "\n" not in error.message
    assert errors[None]["error"]["code"] == "malformed_row"
    assert errors["tools"]["error"]["message"].startswith("unsupported_request: body key 'tools' is not supported")
    assert errors["xml"]["error"]["message"] == ("bad_response_format: field 'body.response_format': type 'xml' is "
                                                 "not one of json_schema, json_object, text")
    assert errors["embed"]["error"]["message"].startswith("unsupported_request: url '/v1/embeddings' is not supported")
    rejected = [json.loads(x) for x in (batch_run["run_dir"] / "rejected.jsonl").read_text().splitlines()]
    assert sorted(r["prompt_id"] or "" for r in rejected) == ["", "embed", "tools", "xml"]


def test_a_run_of_native_rows_is_refused_by_the_batch_export_in_one_line(batch_run, tmp_path, capsys):
    run_json = batch_run["run_dir"] / "run.json"
    info = json.loads(run_json.read_text())
    info["sample_affecting"]["corpus"]["format"] = "rows"
    copy = tmp_path / "run"
    shutil.copytree(batch_run["run_dir"], copy, ignore=shutil.ignore_patterns(".lock"))
    (copy / "run.json").write_text(json.dumps(info))
    out = tmp_path / "out.jsonl"
    assert main(["export", str(copy), "--output", str(out), "--format", "openai_batch", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert "not planned from an OpenAI Batch file" in err and "\n" not in err and not out.exists()
