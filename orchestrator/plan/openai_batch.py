"""Corpus lines in OpenAI Batch input format (`corpus.format: openai_batch`), mapped to native rows:

    {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "m", "messages": [...], "max_tokens": 64, "temperature": 0.7, "n": 2, "seed": 1,
              "stop": ["\\n\\n"], "response_format": {"type": "json_schema", "json_schema": {"schema": {...}}}}}
    ->  {"id": "r1", "messages": [...], "sampling": {"max_new_tokens": 64, "temperature": 0.7, "seed": 1,
         "stop": ["\\n\\n"], "json_schema": {...}}, "openai": {"url": "/v1/chat/completions", "n": 2}}

`custom_id` is the row's id, `body.messages` its chat (`/v1/chat/completions`, with vLLM's `chat_template_kwargs`
for its template) or `body.prompt` its text (`/v1/completions`), the body's sampling keys its own sampling settings
(row_sampling; keys it does not set keep the run's `sampling.*`), `response_format` its structured output
(response_format.py). `body.n` is kept for the export, which writes a line's first n samples; the run samples
`sampling.n` per row, so a line's n above it is refused.
`model`, `user`, `metadata` and the other keys that change no completion are accepted and ignored (the run's model
answers every line); any other body key (`tools`, `logit_bias`, ...), another url or method rejects the row with
one line naming it, never silently ignored.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from engine import SamplingConfig
from orchestrator.plan.corpus import CorpusConfig, RawRow
from orchestrator.plan.rejection import Rejection, a_type
from orchestrator.plan.response_format import response_format_keys
from orchestrator.plan.row_sampling import row_overrides

URLS = {"/v1/chat/completions": "messages", "/v1/completions": "prompt"}
"""The request urls a line may name, and the body key holding its prompt."""

SAMPLING_KEYS = {"max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens",
                 "temperature": "temperature", "top_p": "top_p", "seed": "seed", "stop": "stop",
                 "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
                 "top_k": "top_k", "min_p": "min_p", "repetition_penalty": "repetition_penalty",
                 "stop_token_ids": "stop_token_ids", "min_tokens": "min_tokens", "ignore_eos": "ignore_eos"}
"""Body keys that set a row's sampling: OpenAI's name (or vLLM's extra sampling parameter: top_k, min_p,
repetition_penalty, stop_token_ids, min_tokens, ignore_eos, with vLLM's meaning) -> the `sampling.*` key."""

IGNORED_KEYS = ("model", "user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key",
                "parallel_tool_calls")
"""Body keys that change no completion: accepted and ignored (`model` included: the run's model answers)."""

OFF_VALUES = {"logprobs": (False,), "top_logprobs": (0,), "stream": (False,), "echo": (False,), "best_of": (1,),
              "modalities": (["text"],)}
"""Body keys accepted only at these values (what they are when absent); any other value rejects the row."""

TEMPLATE_KWARGS = "chat_template_kwargs"
"""The chat body key (vLLM's) holding variables for the chat template, kept in the native row's column of that name."""

REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
"""`body.reasoning_effort` values (vLLM's): a chat line's template gets it as `reasoning_effort`, and `enable_thinking`
as whether it is not "none" unless the line's chat_template_kwargs set that."""

NATIVE_FIELDS = {"id_field": "id", "text_field": "prompt", "messages_field": "messages",
                 "token_ids_field": "prompt_token_ids", "sampling_field": "sampling", "response_format_field": None}
"""The fields of the native rows the lines become (the corpus.*_field keys do not apply to such a corpus)."""

REQUEST_COLUMN = "openai"
"""The native row's column (passed through to its samples) holding the line's url and n, for the export."""


def row_fields(corpus: CorpusConfig) -> CorpusConfig:
    """The corpus config the rows are read with: the native fields for an OpenAI Batch corpus, else as given."""
    return replace(corpus, **NATIVE_FIELDS) if corpus.format == "openai_batch" else corpus


def native_row(raw: RawRow, base: SamplingConfig) -> RawRow:
    """The native row an OpenAI Batch line holds, or the line with the reason it cannot run (a line whose
    custom_id can be read keeps it as its id, so rejected.jsonl names it)."""
    if raw.reason is not None:
        return raw
    line = raw.record
    custom_id = line.get("custom_id")
    known = {"id": custom_id} if isinstance(custom_id, str) else None
    mapped = _map(line, base)
    if isinstance(mapped, Rejection):
        return replace(raw, record=known, reason=mapped.reason, detail=mapped.detail)
    return replace(raw, record=mapped)


def _map(line: dict, base: SamplingConfig) -> dict | Rejection:
    custom_id = line.get("custom_id")
    if custom_id is None:
        return Rejection("missing_field", "line has no 'custom_id'")
    if not isinstance(custom_id, str):
        return Rejection("wrong_type", f"'custom_id' is {a_type(custom_id)}, not a string")
    extra = sorted(set(line) - {"custom_id", "method", "url", "body"})
    if extra:
        return Rejection("unsupported_request", f"line key {extra[0]!r} is not part of an OpenAI Batch request "
                                                "(custom_id, method, url, body)")
    method, url, body = line.get("method", "POST"), line.get("url"), line.get("body")
    if method != "POST":
        return Rejection("unsupported_request", f"method {method!r} is not supported; requests are POST")
    if url not in URLS:
        return Rejection("unsupported_request", f"url {url!r} is not supported; pagefleet answers "
                                                f"{' and '.join(URLS)}")
    if not isinstance(body, dict):
        return Rejection("wrong_type" if body is not None else "missing_field",
                         f"'body' is {a_type(body)}, not an object" if body is not None else "line has no 'body'")
    prompt = _prompt(body, URLS[url])
    if isinstance(prompt, Rejection):
        return prompt
    sampling: dict[str, Any] = {}
    for key, value in body.items():
        if value is None or key in IGNORED_KEYS or key in (URLS[url], "n", "response_format") or (
                key in (TEMPLATE_KWARGS, "reasoning_effort") and URLS[url] == "messages"):
            continue
        if key in OFF_VALUES:
            if value not in OFF_VALUES[key]:
                return Rejection("unsupported_request", f"body.{key} {value!r} is not supported (only "
                                                        f"{OFF_VALUES[key][0]!r}); remove it from the line")
            continue
        if key not in SAMPLING_KEYS:
            return Rejection("unsupported_request", f"body key {key!r} is not supported: it would change the "
                                                    "completions and pagefleet does not implement it; remove it "
                                                    "from the line")
        if SAMPLING_KEYS[key] in sampling:
            return Rejection("bad_sampling", "body sets both 'max_tokens' and 'max_completion_tokens'; keep one")
        if key == "stop" and isinstance(value, str):
            value = [value]
        elif key == "top_k" and type(value) is int and value == -1:
            value = 0  # vLLM's other way to say "every token"
        own = {SAMPLING_KEYS[key]: value}
        checked = row_overrides(own, base, f"body.{key}")
        if isinstance(checked, Rejection):
            return checked
        sampling.update(checked)
    structured = response_format_keys(body.get("response_format"), "body.response_format")
    if isinstance(structured, Rejection):
        return structured
    sampling.update(structured)
    if isinstance(checked := row_overrides(sampling, base, "body"), Rejection):
        return checked
    n = 1 if body.get("n") is None else body["n"]
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        return Rejection("bad_sampling", f"body.n is {n!r}, not a positive integer")
    if n > base.n:
        return Rejection("bad_sampling", f"body.n is {n} but the run samples sampling.n = {base.n} per prompt; run "
                                         f"with --sampling.n={n} or more (the export keeps each line's own n)")
    field = NATIVE_FIELDS["token_ids_field"] if URLS[url] == "prompt" and _token_ids(prompt) else URLS[url]
    row = {"id": custom_id, field: prompt, REQUEST_COLUMN: {"url": url, "n": n}}
    if URLS[url] == "messages":
        kwargs = _template_kwargs(body)
        if isinstance(kwargs, Rejection):
            return kwargs
        if kwargs is not None:
            row[TEMPLATE_KWARGS] = kwargs  # checked with the chat (corpus.extract_prompt)
    return {**row, "sampling": sampling} if sampling else row


def _template_kwargs(body: dict) -> Any:
    """A chat line's chat_template_kwargs as vLLM passes them, with its reasoning_effort (REASONING_EFFORTS)."""
    kwargs, effort = body.get(TEMPLATE_KWARGS), body.get("reasoning_effort")
    if effort is None or not (kwargs is None or isinstance(kwargs, dict)):
        return kwargs
    if effort not in REASONING_EFFORTS:
        return Rejection("unsupported_request", f"body.reasoning_effort {effort!r} is not one of "
                                                f"{', '.join(REASONING_EFFORTS)}")
    return {**(kwargs or {}), "reasoning_effort": effort, "enable_thinking": (kwargs or {}).get(
        "enable_thinking", effort != "none")}


def _prompt(body: dict, key: str) -> str | list | Rejection:
    """The body's chat, as given (checked as any row's chat is: chat.parse_messages), or its text prompt."""
    value = body.get(key)
    if value is None:
        return Rejection("missing_field", f"body has no {key!r}")
    if key == "prompt" and not (isinstance(value, str) or _token_ids(value)):
        return Rejection("unsupported_request", f"body.prompt is {a_type(value)}; one prompt (a string, or a list of "
                                                "token ids) per line")
    if key == "messages" and not isinstance(value, list):
        return Rejection("wrong_type", f"body.messages is {a_type(value)}, not a list")
    return value


def _token_ids(value: Any) -> bool:
    """A completions body's prompt given as token ids (OpenAI's and vLLM's one-prompt array of integers)."""
    return (isinstance(value, list) and bool(value)
            and all(isinstance(t, int) and not isinstance(t, bool) for t in value))
