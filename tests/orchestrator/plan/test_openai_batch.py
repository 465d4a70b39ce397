"""OpenAI Batch request lines as native rows (plan/openai_batch.py): the body's keys map to the row's prompt, sampling
settings and structured output; a key, url or value pagefleet cannot honour rejects the line in one line naming it."""

import pytest

from engine import SamplingConfig
from orchestrator.config import load_run_config
from orchestrator.config_errors import ConfigError
from orchestrator.plan.corpus import CorpusConfig, RawRow, extract_prompt
from orchestrator.plan.openai_batch import native_row, row_fields

BASE = SamplingConfig(max_new_tokens=16, n=2)
CHAT = [{"role": "user", "content": "hi"}]


def _map(body: dict, url: str = "/v1/chat/completions", **line) -> RawRow:
    return native_row(RawRow(0, "f.jsonl", 1, {"custom_id": "c1", "method": "POST", "url": url, "body": body, **line}),
                      BASE)


def test_a_chat_line_becomes_a_native_row_with_its_own_sampling():
    raw = _map({"model": "gpt-4o-mini", "user": "u", "metadata": {"k": "v"}, "store": False, "messages": CHAT,
                "max_completion_tokens": 8, "temperature": 0.5, "top_p": 0.9, "seed": 3, "stop": "\n", "n": 2,
                "presence_penalty": 0.1, "frequency_penalty": 0.2, "logprobs": False,
                "response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": True,
                                                                          "schema": {"type": "object"}}}})
    assert raw.reason is None
    assert raw.record == {"id": "c1", "messages": CHAT, "openai": {"url": "/v1/chat/completions", "n": 2},
                          "sampling": {"max_new_tokens": 8, "temperature": 0.5, "top_p": 0.9, "seed": 3,
                                       "stop": ["\n"], "presence_penalty": 0.1, "frequency_penalty": 0.2,
                                       "json_schema": {"type": "object"}}}


def test_vllms_extra_sampling_keys_set_the_rows_own_with_vllms_meaning():
    """A Batch file written for vLLM (Qwen3's recommended settings: top_k 20, min_p 0) runs with them."""
    raw = _map({"messages": CHAT, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0,
                "repetition_penalty": 1.1, "stop_token_ids": [7, 9], "min_tokens": 2, "ignore_eos": True})
    assert raw.record["sampling"] == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0,
                                      "repetition_penalty": 1.1, "stop_token_ids": [7, 9], "min_tokens": 2,
                                      "ignore_eos": True}
    assert _map({"messages": CHAT, "top_k": -1}).record["sampling"] == {"top_k": 0}  # vLLM's "every token"
    for body, detail in [({"top_k": -2}, "top_k"), ({"top_k": True}, "top_k is a bool"),
                         ({"stop_token_ids": 7}, "stop_token_ids must be a list"),
                         ({"min_tokens": "2"}, "min_tokens is a str, not an integer"),
                         ({"max_tokens": 4, "min_tokens": 5}, "min_tokens must be in [0, max_new_tokens = 4], got 5"),
                         ({"ignore_eos": 1}, "ignore_eos is an int, not a boolean"),
                         ({"ignore_eos": True, "response_format": {"type": "json_object"}},
                          "ignore_eos cannot be used with a structured output"),
                         ({"logit_bias": {"7": 5}}, "'logit_bias' is not supported")]:
        raw = _map({"messages": CHAT, **body})
        assert raw.reason in ("bad_sampling", "unsupported_request") and detail in raw.detail, raw.detail


def test_keys_it_does_not_set_and_null_values_keep_the_run_settings():
    raw = _map({"messages": CHAT, "temperature": None, "response_format": {"type": "text"}})
    assert raw.record == {"id": "c1", "messages": CHAT, "openai": {"url": "/v1/chat/completions", "n": 1}}


def test_a_chat_is_kept_as_given_and_completions_take_a_prompt():
    """The chat is judged and rendered as any row's (plan/chat.py, test_chat.py): content parts are not joined here,
    and a part that is not text rejects the line there."""
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert _map({"messages": parts}).record["messages"] == parts
    image = _map({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]})
    rejection = extract_prompt(image, row_fields(CorpusConfig(format="openai_batch")))
    assert rejection.reason == "unsupported_request" and "content part of type 'image_url'" in rejection.detail
    raw = _map({"prompt": "once upon", "max_tokens": 4}, url="/v1/completions")
    assert raw.record == {"id": "c1", "prompt": "once upon", "openai": {"url": "/v1/completions", "n": 1},
                          "sampling": {"max_new_tokens": 4}}
    raw = _map({"prompt": [5, 6, 7]}, url="/v1/completions")  # one prompt as token ids (OpenAI's and vLLM's array)
    assert raw.record == {"id": "c1", "prompt_token_ids": [5, 6, 7], "openai": {"url": "/v1/completions", "n": 1}}
    assert extract_prompt(raw, row_fields(CorpusConfig(format="openai_batch"))).token_ids == [5, 6, 7]


@pytest.mark.parametrize("body, url, reason, detail", [
    ({"messages": CHAT, "tools": []}, None, "unsupported_request", "body key 'tools' is not supported"),
    ({"messages": CHAT, "logit_bias": {"5": 10}}, None, "unsupported_request", "body key 'logit_bias' is not supported"),
    ({"messages": CHAT, "logprobs": True}, None, "unsupported_request", "body.logprobs True is not supported"),
    ({"messages": CHAT, "response_format": {"type": "xml"}}, None, "bad_response_format",
     "field 'body.response_format': type 'xml' is not one of json_schema, json_object, text"),
    ({"messages": CHAT, "response_format": {"type": "json_schema"}}, None, "bad_response_format",
     "needs json_schema.schema"),
    ({"input": "x"}, "/v1/embeddings", "unsupported_request", "url '/v1/embeddings' is not supported"),
    ({"messages": CHAT, "temperature": "hot"}, None, "bad_sampling", "field 'body.temperature': temperature is a str"),
    ({"messages": CHAT, "max_tokens": 4, "max_completion_tokens": 5}, None, "bad_sampling", "keep one"),
    ({"messages": CHAT, "n": 3}, None, "bad_sampling", "body.n is 3 but the run samples sampling.n = 2"),
    ({"prompt": "x"}, None, "missing_field", "body has no 'messages'"),
    ({"prompt": ["a", "b"]}, "/v1/completions", "unsupported_request", "one prompt (a string, or a list of token ids) "
                                                                       "per line"),
    ({"prompt": [[1, 2], [3]]}, "/v1/completions", "unsupported_request", "body.prompt is a list"),
    ({"prompt": [1, True]}, "/v1/completions", "unsupported_request", "body.prompt is a list"),
])
def test_what_cannot_be_honoured_rejects_the_line_in_one_line(body, url, reason, detail):
    raw = _map(body, url or "/v1/chat/completions")
    assert raw.reason == reason and detail in raw.detail and "\n" not in raw.detail
    assert raw.record == {"id": "c1"}  # rejected.jsonl names the line


def test_a_line_without_a_custom_id_or_another_method():
    assert native_row(RawRow(0, "f", 1, {"url": "/v1/chat/completions", "body": {"messages": CHAT}}), BASE).reason \
        == "missing_field"
    raw = _map({"messages": CHAT}, method="GET")
    assert raw.reason == "unsupported_request" and "method 'GET'" in raw.detail


def test_the_format_key_is_checked_and_fixes_the_row_fields():
    cfg = load_run_config(None, ["--corpus.format=openai_batch", "--corpus.messages_field=chat"])
    assert row_fields(cfg.corpus).messages_field == "messages" and row_fields(cfg.corpus).response_format_field is None
    assert row_fields(CorpusConfig(messages_field="chat")).messages_field == "chat"
    with pytest.raises(ConfigError, match="corpus.format"):
        load_run_config(None, ["--corpus.format=openai"])
