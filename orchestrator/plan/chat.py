"""Chats: the messages a row (or an OpenAI Batch line) gives, checked, and the conversation its tokenizer's chat
template renders, handed over as vLLM hands it (vLLM's `LLM.chat`, its OpenAI server and `run-batch`), so a chat
becomes the same prompt tokens in pagefleet as there. Planning, `pagefleet generate` and the Python API all render
through `render_chat`.

A message is an object with a string `role` and a `content` that is a string, a list of text parts, or null (or
absent) for an assistant message with `tool_calls`. A text part is a string or an object of type `text`,
`input_text` or `output_text` (its `text`), `refusal` (its `refusal`) or `thinking` (its `thinking`); a `text` or
`refusal` part whose text is null is skipped. Any other part (an image, audio) rejects the row: pagefleet samples
text. What the template gets (chat_template.content_format):

- a template that loops over a message's content (Gemma 3's, Llama 4's) gets the content as a list of
  `{"type": "text", "text": ...}` parts, a string content as one part;
- any other template gets one string: the parts' texts joined with a newline ("" for none). A `tool` message's
  content is that string for both.

A message keeps `name` and `task` (when strings), an assistant message its `tool_calls` (each call's
`function.arguments` as an object: a JSON string is parsed, and one that is not a JSON object becomes `{}`, as does
a missing one; an empty list is left out) and its `reasoning` (also given as `reasoning_content`), a `tool` message
its `tool_call_id`, a `developer` message its `tools`; other keys of a message do not reach the template. For a
template that never names the `developer` role, developer messages become system messages, and when that leaves a
system message anywhere but first, or more than one, they are merged into one at the front, their texts joined
with a blank line. Variables for the template (`chat_template_kwargs`, `template_kwargs`) pass as vLLM passes them:
the ones the template reads, and transformers' own arguments; the generation prompt stays on.
"""

from __future__ import annotations

import json
from typing import Any

from orchestrator.plan.chat_template import (NOT_KWARGS, ContentFormat, content_format, template_arguments,
                                            template_variables)
from orchestrator.plan.rejection import Rejection, a_type, text_value

TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal", "thinking": "thinking"}
"""Content part types that hold text -> the key holding it."""

SKIPPED_WHEN_NULL = ("text", "refusal")
"""Text part types left out when their text is null (any other text part's null text rejects the row)."""


def parse_messages(value: Any, field: str) -> list[dict] | Rejection:
    """The chat a row's `field` holds, each message's content as the list of its texts, with the keys the template
    gets (see the module); or why it cannot be rendered."""
    if not isinstance(value, list):
        return Rejection("wrong_type", f"field {field!r} is {a_type(value)}, not a list")
    if not value:
        return Rejection("empty_prompt", f"field {field!r} is an empty list")
    return _each(value)


def _each(value: list) -> list[dict] | Rejection:
    messages = []
    for i, message in enumerate(value):
        if not isinstance(message, dict) or "role" not in message:
            return Rejection("wrong_type", f"message {i} is not an object with 'role' and 'content'")
        role = text_value(message["role"], f"message {i} role")
        if isinstance(role, Rejection):
            return role
        content = message.get("content")
        calls = message.get("tool_calls") if role == "assistant" else None
        if content is None and calls is None:
            return Rejection("wrong_type", f"message {i} has no 'content' (only an assistant message with "
                                           "'tool_calls' may leave it out)")
        texts = _texts(content, i)
        if isinstance(texts, Rejection):
            return texts
        parsed: dict[str, Any] = {"role": role, "content": texts}
        if calls is not None:
            calls = _tool_calls(calls, i)
            if isinstance(calls, Rejection):
                return calls
            if calls:
                parsed["tool_calls"] = calls
        if role == "assistant" and message.get("reasoning") is not None:
            reasoning = text_value(message["reasoning"], f"message {i} reasoning")
            if isinstance(reasoning, Rejection):
                return reasoning
            parsed["reasoning"] = parsed["reasoning_content"] = reasoning
        if role == "tool" and "tool_call_id" in message:
            parsed["tool_call_id"] = message["tool_call_id"]
        for key in ("name", "task"):
            if isinstance(message.get(key), str):
                parsed[key] = message[key]
        if role == "developer":
            parsed["tools"] = message.get("tools")
        messages.append(parsed)
    return messages


def _texts(content: Any, i: int) -> list[str] | Rejection:
    if content is None:
        return []
    if not isinstance(content, list):
        text = text_value(content, f"message {i} content")
        return text if isinstance(text, Rejection) else [text]
    texts = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
            continue
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS:
            what = f"of type {kind!r}" if isinstance(part, dict) else a_type(part)
            return Rejection("unsupported_request", f"message {i} has a content part {what}; only text parts are "
                                                    "supported")
        text = part.get(TEXT_PARTS[kind])
        if text is None and kind in SKIPPED_WHEN_NULL:
            continue
        text = text_value(text, f"message {i}'s {kind!r} part's {TEXT_PARTS[kind]!r}")
        if isinstance(text, Rejection):
            return text
        texts.append(text)
    return texts


def _tool_calls(calls: Any, i: int) -> list[dict] | Rejection:
    if not isinstance(calls, list):
        return Rejection("wrong_type", f"message {i} tool_calls is {a_type(calls)}, not a list")
    out = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or call.get("type", "function") != "function":
            return Rejection("wrong_type", f"message {i} has a tool call that is not an object of type 'function' "
                                           "with a 'function' object")
        out.append({**call, "function": {**function, "arguments": _arguments(function.get("arguments"))}})
    return out


def _arguments(arguments: Any) -> dict:
    if isinstance(arguments, str) and arguments:
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return {}
    return arguments if isinstance(arguments, dict) else {}


def conversation(messages: list[dict], form: ContentFormat, template: str) -> list[dict]:
    """The messages (`parse_messages`) as a template in `form` that reads `template` gets them (see the module)."""
    out = []
    for message in messages:
        texts = message["content"]
        content: str | list = "\n".join(texts) if form == "string" or message["role"] == "tool" else [
            {"type": "text", "text": text} for text in texts]
        out.append({**message, "content": content})
    if any(m["role"] == "developer" for m in out) and "'developer'" not in template and '"developer"' not in template:
        out = _merged_system([{k: v for k, v in m.items() if k != "tools"} | {"role": "system"}
                              if m["role"] == "developer" else m for m in out])
    return out


def _merged_system(messages: list[dict]) -> list[dict]:
    systems = [i for i, m in enumerate(messages) if m["role"] == "system"]
    if not systems or systems == [0]:
        return messages
    texts = []
    for i in systems:
        content = messages[i]["content"]
        text = content if isinstance(content, str) else "\n".join(part["text"] for part in content)
        if text:
            texts.append(text)
    return [{"role": "system", "content": "\n\n".join(texts)}, *(m for m in messages if m["role"] != "system")]


def template_kwargs(value: Any, where: str) -> dict | Rejection | None:
    """A row's (or the run's) chat_template_kwargs: variables for the chat template, as vLLM's request field of that
    name (`{"enable_thinking": false}`), or why they cannot be."""
    if value is None:
        return None
    if not isinstance(value, dict):
        return Rejection("bad_chat_template_kwargs", f"{where} is {a_type(value)}, not an object")
    if refused := [key for key in NOT_KWARGS if key in value]:
        return Rejection("bad_chat_template_kwargs", f"{where} may not set {refused[0]!r} (the chat template is the "
                                                     "tokenizer's, and the prompt is rendered, then tokenized)")
    return value


def unread_kwargs(tokenizer, tokenizer_path: str, kwargs: dict) -> str | None:
    """Why the run's corpus.chat_template_kwargs cannot be, or None: a variable the chat template never reads would
    change no prompt (a misspelt `enable_thinking` samples the template's default unsaid), and a tokenizer without a
    chat template renders none."""
    template = chat_template(tokenizer)
    if template is None:
        return (f"corpus.chat_template_kwargs is set but the tokenizer ({tokenizer_path}) has no chat template; remove "
                "it, or set model.tokenizer to a tokenizer with one")
    if unread := sorted(set(kwargs) - template_arguments(template)):
        reads = ", ".join(sorted(template_variables(template) - {"messages", "add_generation_prompt"})) or "none"
        return (f"corpus.chat_template_kwargs.{unread[0]}: the chat template reads no variable {unread[0]!r} (the "
                f"variables it reads: {reads}); fix the name or remove it")
    return None


def chat_template(tokenizer) -> str | None:
    """The tokenizer's chat template (the default one of its named ones), or None."""
    try:
        return tokenizer.get_chat_template() if getattr(tokenizer, "chat_template", None) is not None else None
    except ValueError:  # named templates, none of them the default
        return None


def render_chat(tokenizer, messages: list[dict], tokenizer_path: str, field: str | None = "messages",
                kwargs: dict | None = None) -> str | Rejection:
    """The chat (`parse_messages`) as the tokenizer's chat template renders it with a generation prompt and the
    `kwargs` (`template_kwargs`) it reads (others are left out, as vLLM leaves them), or a `no_chat_template`
    Rejection when the tokenizer has no template or its template refuses the chat (raises)."""
    template = chat_template(tokenizer)
    if template is None:
        return Rejection("no_chat_template", f"row has {field!r} but the tokenizer ({tokenizer_path}) has no chat "
                                             "template; give the row as prompt text, or set model.tokenizer to a "
                                             "tokenizer with a chat template")
    chat = conversation(messages, content_format(template), template)
    given = {key: value for key, value in kwargs.items() if key in template_arguments(template)} if kwargs else {}
    try:
        return tokenizer.apply_chat_template(chat, chat_template=template, tokenize=False, **{
            **given, "add_generation_prompt": True, "continue_final_message": False})
    except Exception as e:  # noqa: BLE001 - a template may raise on any row (jinja's raise_exception): one row's fault
        return Rejection("no_chat_template", f"the tokenizer's chat template refused the row: "
                                             f"{type(e).__name__}: {str(e)[:300]}")
