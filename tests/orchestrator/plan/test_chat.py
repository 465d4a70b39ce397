"""Chats reach the chat template as vLLM hands them over (plan/chat.py, plan/chat_template.py): content parts as a
list for a template that loops over a message's content, joined with newlines for any other; tool calls, names and
reasoning kept; developer messages as system ones for a template that does not know the role. The expected
renderings below are what vLLM 0.32's `LLM.chat` renders for these chats (compared with it token for token on
templates of these shapes and on real models' templates)."""

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from engine import SamplingConfig
from engine.config import EngineConfig
from orchestrator.local.generate import parse_lines
from orchestrator.plan.chat import parse_messages, render_chat, template_kwargs, unread_kwargs
from orchestrator.plan.chat_template import content_format
from orchestrator.plan.corpus import CorpusConfig, Shard
from orchestrator.plan.model_source import ModelSourceConfig
from orchestrator.plan.packing import PackingConfig, PackingLimits
from orchestrator.plan.rejection import Rejection
from orchestrator.plan.tokenize import PromptTokenizer

END = "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
STRING = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}"
          "{% if m.name is defined %}[name={{ m.name }}]{% endif %}"
          "{% if m.tool_calls is defined %}{% for c in m.tool_calls %}CALL {{ c.function.name }} "
          "{{ c.function.arguments | tojson }};{% endfor %}{% endif %}"
          "{% if m.reasoning_content is defined %}R:{{ m.reasoning_content }}{% endif %}"
          "{% if m.tool_call_id is defined %}ID:{{ m.tool_call_id }}{% endif %}<|end|>\n{% endfor %}" + END)
PARTS = ("{% for message in messages %}<|{{ message['role'] }}|>\n{% if message['content'] is string %}S:{{ "
         "message['content'] | trim }}{% else %}{% for item in message['content'] %}P:{{ item['text'] | trim }}|"
         "{% endfor %}{% endif %}<|end|>\n{% endfor %}" + END)
NAMES_DEVELOPER = ("{% for m in messages %}{% if m.role == 'developer' %}DEV {% endif %}<|{{ m['role'] }}|>\n"
                   "{{ m['content'] }}<|end|>\n{% endfor %}" + END)


def text(t):
    return {"type": "text", "text": t}


@pytest.mark.parametrize("template, form", [
    (STRING, "string"),
    (PARTS, "openai"),
    # messages through a `set` alias with a slice, content through a filter
    ("{% set loop_messages = messages[1:] %}{% for message in loop_messages %}{% for c in message.content | "
     "selectattr('type', 'equalto', 'text') %}{{ c.text }}{% endfor %}{% endfor %}", "openai"),
    # content passed to a macro, by position and by keyword
    ("{% macro r(c) %}{% for p in c %}{{ p.text }}{% endfor %}{% endmacro %}{% for m in messages %}{{ r(m.content) }}"
     "{% endfor %}", "openai"),
    ("{% macro r(x, c) %}{% for p in c %}{{ p.text }}{% endfor %}{% endmacro %}{% for m in messages %}"
     "{{ r(1, c=m['content']) }}{% endfor %}", "openai"),
    # a macro looping over a parameter no call gives a message's content
    ("{% macro r(c) %}{% for p in c %}{{ p }}{% endfor %}{% endmacro %}{% for m in messages %}{{ r(m.role) }}"
     "{{ m.content }}{% endfor %}", "string"),
    # a loop over a variable named content, outside every macro
    ("{% for m in messages %}{% set content = m.content %}{% for p in content %}{{ p.text }}{% endfor %}"
     "{% endfor %}", "openai"),
    # Qwen3's way: content set from the message, never looped over
    ("{% for message in messages %}{% if message.content is string %}{% set content = message.content %}{% else %}"
     "{% set content = '' %}{% endif %}{{ content }}{% endfor %}", "string"),
    # the walk cannot follow a loop over the messages whose target is not a name: string, as vLLM decides
    ("{% if false %}{% for m, n in messages %}{% endfor %}{% endif %}" + PARTS, "string"),
    # transformers' {% generation %} tag parses; a template that does not parse is string
    ("{% for m in messages %}{% generation %}{% for p in m['content'] %}{{ p.text }}{% endfor %}{% endgeneration %}"
     "{% endfor %}", "openai"),
    ("{% for m in messages %}{{ m.content }", "string"),
])
def test_the_content_format_is_read_from_the_templates_syntax(template, form):
    assert content_format(template) == form


@pytest.fixture(scope="module")
def tok(tiny_model):
    return AutoTokenizer.from_pretrained(tiny_model)


def render(tok, template, messages):
    tok.chat_template = template
    parsed = parse_messages(messages, "messages")
    assert not isinstance(parsed, Rejection), parsed
    return render_chat(tok, parsed, "tok")


KINDS = [{"role": "system", "content": "Be brief."},
         {"role": "user", "content": [text("a "), text(None), {"type": "refusal", "refusal": "no"},
                                      {"type": "input_text", "text": "it"}, {"type": "output_text", "text": "ot"},
                                      {"type": "thinking", "thinking": "hm"}, "bare"]}]


def test_content_parts_are_joined_with_newlines_for_a_string_template_and_given_as_parts_to_one_that_loops(tok):
    assert render(tok, STRING, KINDS) == "<|system|>\nBe brief.<|end|>\n<|user|>\na \nno\nit\not\nhm\nbare<|end|>\n" \
                                         "<|assistant|>\n"
    # a string content is one part too: the template's list branch renders it
    assert render(tok, PARTS, KINDS) == "<|system|>\nP:Be brief.|<|end|>\n<|user|>\nP:a|P:no|P:it|P:ot|P:hm|P:bare|" \
                                        "<|end|>\n<|assistant|>\n"


TOOLS = [{"role": "user", "content": "weather?", "name": "bob", "weight": 1},
         {"role": "assistant", "content": None, "reasoning": "think", "tool_calls": [
             {"id": "1", "type": "function", "function": {"name": "get", "arguments": "{\"city\": \"Oslo\"}"}},
             {"id": "2", "type": "function", "function": {"name": "bad", "arguments": "{not json"}},
             {"id": "3", "type": "function", "function": {"name": "list", "arguments": "[1, 2]"}},
             {"id": "4", "type": "function", "function": {"name": "none"}}]},
         {"role": "tool", "tool_call_id": "1", "content": [text("sunny"), text("12C")]},
         {"role": "assistant", "content": "ok", "tool_calls": []}]


def test_tool_calls_names_and_reasoning_reach_the_template_and_tool_results_are_one_string(tok):
    assert render(tok, STRING, TOOLS) == (
        "<|user|>\nweather?[name=bob]<|end|>\n<|assistant|>\nCALL get {\"city\": \"Oslo\"};CALL bad {};CALL list {};"
        "CALL none {};R:think<|end|>\n<|tool|>\nsunny\n12CID:1<|end|>\n<|assistant|>\nok<|end|>\n<|assistant|>\n")
    assert render(tok, PARTS, TOOLS[2:]) == \
        "<|tool|>\nS:sunny\n12C<|end|>\n<|assistant|>\nP:ok|<|end|>\n<|assistant|>\n"


DEVELOPER = [{"role": "system", "content": "S1"}, {"role": "user", "content": "u1"},
             {"role": "developer", "content": [text("D1"), text("D2")]}, {"role": "system", "content": ""},
             {"role": "user", "content": "u2"}]


def test_developer_messages_are_system_ones_merged_at_the_front_unless_the_template_names_the_role(tok):
    merged = "<|system|>\nS1\n\nD1\nD2<|end|>\n<|user|>\nu1<|end|>\n<|user|>\nu2<|end|>\n<|assistant|>\n"
    assert render(tok, STRING, DEVELOPER) == merged
    # the merged system message is one string, whatever the template
    assert render(tok, PARTS, DEVELOPER) == merged.replace("S1", "S:S1").replace("u1", "P:u1|").replace("u2", "P:u2|")
    assert render(tok, STRING, DEVELOPER[2:3]) == "<|system|>\nD1\nD2<|end|>\n<|assistant|>\n"
    assert render(tok, NAMES_DEVELOPER, DEVELOPER) == (
        "<|system|>\nS1<|end|>\n<|user|>\nu1<|end|>\nDEV <|developer|>\nD1\nD2<|end|>\n<|system|>\n<|end|>\n"
        "<|user|>\nu2<|end|>\n<|assistant|>\n")


@pytest.mark.parametrize("messages, reason, detail", [
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "unsupported_request",
     "message 0 has a content part of type 'image_url'; only text parts are supported"),
    ([{"role": "user", "content": [3]}], "unsupported_request", "message 0 has a content part an int"),
    ([{"role": "user", "content": None}], "wrong_type", "message 0 has no 'content'"),
    ([{"role": "user"}], "wrong_type", "message 0 has no 'content'"),
    ([{"content": "x"}], "wrong_type", "message 0 is not an object with 'role' and 'content'"),
    ([{"role": "user", "content": 3}], "wrong_type", "message 0 content is an int, not a string"),
    ([{"role": "user", "content": [{"type": "thinking", "thinking": None}]}], "wrong_type", "'thinking' part"),
    ([{"role": "assistant", "content": None, "tool_calls": {"a": 1}}], "wrong_type", "tool_calls is a dict"),
    ([{"role": "assistant", "content": None, "tool_calls": [{"type": "web"}]}], "wrong_type",
     "not an object of type 'function'"),
    ([{"role": "assistant", "content": "x", "reasoning": 3}], "wrong_type", "message 0 reasoning is an int"),
    ([], "empty_prompt", "field 'messages' is an empty list"),
    ({"role": "user"}, "wrong_type", "field 'messages' is a dict, not a list"),
])
def test_a_chat_that_cannot_be_rendered_is_rejected_in_one_line(messages, reason, detail):
    got = parse_messages(messages, "messages")
    assert isinstance(got, Rejection) and got.reason == reason and detail in got.detail and "\n" not in got.detail


def stage(model, corpus):
    limits = PackingLimits.resolve(PackingConfig(), EngineConfig(max_pages=1024), SamplingConfig(max_new_tokens=8))
    return PromptTokenizer(ModelSourceConfig(path=model), corpus, limits, 256)


def test_a_chat_plans_and_generates_to_vllms_prompt_tokens_in_both_corpus_formats(tiny_model, tmp_path, tok):
    """Content parts in an OpenAI Batch line and in a row, a tool call in a row's chat: the prompt tokens are the
    template's for vLLM's conversation (parts joined with a newline for this string template, the call kept)."""
    parts = [{"role": "user", "content": [text("first"), text("second")]}]
    calls = [{"role": "user", "content": "go"}, {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}}]}, {"role": "user", "content": "?"}]
    tok.chat_template = STRING
    tok.save_pretrained(tmp_path / "model")
    shutil.copy(f"{tiny_model}/config.json", tmp_path / "model")
    model = str(tmp_path / "model")

    def ids(conversation):
        return tok(tok.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True),
                   add_special_tokens=False)["input_ids"]

    joined = ids([{"role": "user", "content": "first\nsecond"}])
    called = ids([calls[0], {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]}, calls[2]])
    batch = tmp_path / "batch.jsonl"
    batch.write_text(json.dumps({"custom_id": "b", "method": "POST", "url": "/v1/chat/completions",
                                 "body": {"messages": parts}}) + "\n")
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"id": i, "messages": m}) + "\n" for i, m in (("p", parts), ("t", calls))))
    for path, fmt, expected in ((batch, "openai_batch", [joined]), (rows, "rows", [joined, called])):
        table = stage(model, CorpusConfig(format=fmt)).tokenize_shard(
            Shard(str(path), "jsonl", 0, path.stat().st_size)).to_pylist()
        assert [(r["reason"], r["token_ids"]) for r in table] == [(None, e) for e in expected]
    lines = [(i + 1, json.dumps({"id": i, "messages": m}).encode()) for i, m in enumerate((parts, calls))]
    parsed = parse_lines(lines, AutoTokenizer.from_pretrained(model), None, SamplingConfig(max_new_tokens=8))
    assert [(p.error, p.token_ids) for _, p in parsed] == [(None, joined), (None, called)]


THINKING = ("{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}<|end|>\n{% endfor %}<|assistant|>\n"
            "{% if enable_thinking is defined and enable_thinking is false %}<think></think>{% endif %}"
            "{% if documents %}{{ documents | length }} docs{% endif %}")


def test_chat_template_kwargs_reach_the_template_and_keys_it_does_not_read_are_left_out(tok):
    """vLLM's chat_template_kwargs: the template's variables and transformers' own arguments pass; any other key is
    left out (as vLLM leaves it); the generation prompt stays on."""
    tok.chat_template = THINKING
    chat = parse_messages([{"role": "user", "content": "hi"}], "messages")
    plain = "<|user|>\nhi<|end|>\n<|assistant|>\n"
    assert render_chat(tok, chat, "t") == plain
    assert render_chat(tok, chat, "t", kwargs={"enable_thinking": False, "documents": [{"a": 1}], "other": 1,
                                               "add_generation_prompt": False}) == plain + "<think></think>1 docs"
    assert unread_kwargs(tok, "t", {"enable_thinking": False, "documents": []}) is None
    why = unread_kwargs(tok, "t", {"enable_thinkin": False})
    assert why.startswith("corpus.chat_template_kwargs.enable_thinkin: the chat template reads no variable "
                          "'enable_thinkin' (the variables it reads: documents, enable_thinking)"), why
    tok.chat_template = None
    assert "has no chat template" in unread_kwargs(tok, "t", {"enable_thinking": False})
    for value, detail in (({"tokenize": True}, "may not set 'tokenize'"), ([1], "is a list, not an object")):
        got = template_kwargs(value, "field 'chat_template_kwargs'")
        assert got.reason == "bad_chat_template_kwargs" and detail in got.detail


def test_the_runs_chat_template_kwargs_are_under_a_rows_own_in_both_corpus_formats(tiny_model, tmp_path):
    tok = AutoTokenizer.from_pretrained(tiny_model)
    tok.chat_template = THINKING
    tok.save_pretrained(tmp_path / "model")
    shutil.copy(f"{tiny_model}/config.json", tmp_path / "model")
    chat = [{"role": "user", "content": "hi"}]
    lines = [{"custom_id": "on", "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": chat, "chat_template_kwargs": {"enable_thinking": True}}},
             {"custom_id": "default", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": chat}},
             {"custom_id": "text", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": "hi", "chat_template_kwargs": {"enable_thinking": True}}},
             {"custom_id": "bad", "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": chat, "chat_template_kwargs": {"tokenize": True}}},
             # vLLM's reasoning_effort: enable_thinking unless "none", under the line's own chat_template_kwargs
             {"custom_id": "effort", "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": chat, "reasoning_effort": "high"}},
             {"custom_id": "effort_none", "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": chat, "reasoning_effort": "none", "chat_template_kwargs": {"x": 1}}},
             {"custom_id": "effort_under_own", "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": chat, "reasoning_effort": "high",
                       "chat_template_kwargs": {"enable_thinking": False}}},
             {"custom_id": "effort_bad", "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": chat, "reasoning_effort": "extreme"}}]
    batch = tmp_path / "batch.jsonl"
    batch.write_text("".join(json.dumps(line) + "\n" for line in lines))
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"id": "on", "messages": chat, "chat_template_kwargs": {"enable_thinking": True}}) +
                    "\n" + json.dumps({"id": "default", "messages": chat}) + "\n")
    off = CorpusConfig(chat_template_kwargs={"enable_thinking": False})
    texts = {}
    for path, corpus in ((batch, replace(off, format="openai_batch")), (rows, off)):
        for r in stage(str(tmp_path / "model"), corpus).tokenize_shard(
                Shard(str(path), "jsonl", 0, path.stat().st_size)).to_pylist():
            texts[(corpus.format, r["prompt_id"])] = r["reason"] or tok.decode(r["token_ids"])
    assert texts == {("openai_batch", "on"): "<|user|>\nhi<|end|>\n<|assistant|>\n",
                     ("openai_batch", "default"): "<|user|>\nhi<|end|>\n<|assistant|>\n<think></think>",
                     ("openai_batch", "text"): "unsupported_request",
                     ("openai_batch", "bad"): "bad_chat_template_kwargs",
                     ("openai_batch", "effort"): "<|user|>\nhi<|end|>\n<|assistant|>\n",
                     ("openai_batch", "effort_none"): "<|user|>\nhi<|end|>\n<|assistant|>\n<think></think>",
                     ("openai_batch", "effort_under_own"): "<|user|>\nhi<|end|>\n<|assistant|>\n<think></think>",
                     ("openai_batch", "effort_bad"): "unsupported_request",
                     ("rows", "on"): "<|user|>\nhi<|end|>\n<|assistant|>\n",
                     ("rows", "default"): "<|user|>\nhi<|end|>\n<|assistant|>\n<think></think>"}


def test_a_chat_template_kwarg_the_template_never_reads_stops_the_run_at_the_head(tiny_model, tmp_path, capsys):
    from orchestrator.commands.cli import main

    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps({"id": "a", "messages": [{"role": "user", "content": "hi"}]}) + "\n")
    demo = Path(__file__).resolve().parents[3] / "configs" / "demo.yaml"
    args = ["plan", str(demo), f"--model.path={tiny_model}", f"--corpus.path={corpus}", f"--run_dir={tmp_path}/run",
            "--corpus.chat_template_kwargs={enable_thinking: false}"]
    assert main(args) == 2 and not (tmp_path / "run").exists()
    [line] = capsys.readouterr().err.strip().splitlines()
    assert "corpus.chat_template_kwargs.enable_thinking: the chat template reads no variable" in line, line
