"""Scored rows through `pagefleet.generate` and `pagefleet generate`: one record per continuation, text continuations
split as lm-evaluation-harness splits them, one clear line for what cannot run."""

from __future__ import annotations

import json

import lm_eval.api.model as lm_eval_model  # the reference (a dev dependency: never skipped)
import pytest

import pagefleet
from engine import load_tokenizer
from engine.models.presets import write_model
from orchestrator.commands.generate import main as generate_main
from orchestrator.plan.continuation import encode_pair

ENGINE = {"max_seq_len": 128, "max_pages": 64, "max_seqs": 4}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(write_model("tiny-llama", tmp_path_factory.mktemp("m")))


def test_text_continuations_split_as_lm_eval_splits_them(model_dir):
    """lm-eval's own `_encode_pair` (TemplateLM) is the reference, with the tokenizer's default special tokens."""
    tokenizer = load_tokenizer(model_dir)
    encode = lambda t, add_special_tokens=None: tokenizer(t)["input_ids"]  # noqa: E731

    class Ref:
        backend = "causal"
        tok_encode = staticmethod(encode)

    for context, continuation in [("Question: 2+2=\nAnswer:", " 4"), ("The sea is ", "blue"), ("a  ", " b c"),
                                  ("x", "yz")]:
        assert encode_pair(encode, context, continuation) == lm_eval_model.TemplateLM._encode_pair(
            Ref(), context, continuation)


def test_scored_rows_give_one_record_per_continuation(tmp_path, model_dir):
    rows = [{"id": "q", "prompt": "The sea is", "continuation": [" blue", " green and wide"]},
            {"id": "t", "prompt_token_ids": [5, 6, 7, 8], "continuation_token_ids": [9, 10]},
            {"id": "s", "prompt": "Hello"}]
    records = pagefleet.generate(model_dir, rows, engine=ENGINE, max_new_tokens=3)
    assert [(r["prompt_id"], r["generation_index"]) for r in records] == [("q", 0), ("q", 1), ("t", 0), ("s", 0)]
    tokenizer = load_tokenizer(model_dir)
    encode = lambda t: tokenizer(t)["input_ids"]  # noqa: E731
    for record, continuation in zip(records, [" blue", " green and wide"]):
        context_ids, ids = encode_pair(encode, "The sea is", continuation)
        assert record["token_ids"] == ids and record["num_prompt_tokens"] == len(context_ids)
        assert record["completion"] == "" and record["finish_reason"] is None
        assert len(record["continuation_logprobs"]) == len(ids)
        assert record["continuation_logprob"] == pytest.approx(sum(record["continuation_logprobs"]), abs=1e-9)
        assert isinstance(record["is_greedy"], bool) and "prompt" in record
        assert record["continuation"] == [" blue", " green and wide"]  # passed through as typed: generation_index in it
    assert records[2]["token_ids"] == [9, 10] and len(records[2]["continuation_logprobs"]) == 2
    sampled = records[3]
    assert sampled["continuation_logprobs"] is None and sampled["is_greedy"] is None and sampled["token_ids"]

    # The same scores from token ids, and from `pagefleet generate`'s JSON lines.
    context_ids, ids = encode_pair(encode, "The sea is", " blue")
    [by_ids] = pagefleet.generate(model_dir, [{"id": "q", "prompt_token_ids": context_ids,
                                               "continuation_token_ids": ids}], engine=ENGINE)
    assert by_ids["continuation_logprobs"] == records[0]["continuation_logprobs"]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["--model", model_dir, "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl"),
            "--progress=false", "--sampling.max_new_tokens=3", *(f"--engine.{k}={v}" for k, v in ENGINE.items())]
    assert generate_main(args) == 0
    assert [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()] == records


def test_what_cannot_be_scored_is_one_clear_line(model_dir):
    rows = [{"id": "n", "prompt": "The sea is", "continuation": " blue"},
            {"id": "both", "prompt": "a", "continuation": "b", "continuation_token_ids": [5]},
            {"id": "empty", "prompt": "a", "continuation": []},
            {"id": "ids", "prompt_token_ids": [5, 6], "continuation": " b"},
            {"id": "vocab", "prompt_token_ids": [5, 6], "continuation_token_ids": [10 ** 6]}]
    records = pagefleet.generate(model_dir, rows, engine=ENGINE, n=2)
    errors = [r["error"] for r in records]
    assert errors[0] == ("bad_continuation: a row with a continuation is scored, one record per continuation; set "
                         "sampling.n to 1 (it is 2) or drop the continuation")
    assert len(records) == 1 + 4 * 2  # a line that cannot be read gives its n records, each with the error
    assert errors[1] == "bad_continuation: row has both 'continuation' and 'continuation_token_ids'; give one"
    assert errors[3].startswith("bad_continuation: field 'continuation' is ")
    assert errors[5].startswith("bad_continuation: a text 'continuation' is tokenized with its prompt's text")
    assert errors[7].startswith("out_of_vocabulary:")
