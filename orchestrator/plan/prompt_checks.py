"""Checks a prompt needs from the tokenizer and the model, shared by planning (orchestrator.plan.tokenize) and
`pagefleet generate`, so both judge a row the same way and name the same reason: a chat the tokenizer has
no template for (or that its template refuses), and token ids the model has no embedding for.
"""

from __future__ import annotations

from orchestrator.plan.corpus import Rejection


def render_chat(tokenizer, messages: list[dict], tokenizer_path: str, field: str | None = "messages") -> str | Rejection:
    """`apply_chat_template(messages, tokenize=False, add_generation_prompt=True)`, or a `no_chat_template`
    Rejection when the tokenizer has no template, or its template refuses these messages (raises)."""
    if getattr(tokenizer, "chat_template", None) is None:
        return Rejection("no_chat_template", f"row has {field!r} but the tokenizer ({tokenizer_path}) has no chat "
                                             "template; give the row as prompt text, or set model.tokenizer to a "
                                             "tokenizer with a chat template")
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # noqa: BLE001 - a template may raise on any row (jinja's raise_exception): one row's fault
        return Rejection("no_chat_template", f"the tokenizer's chat template refused the row: "
                                             f"{type(e).__name__}: {str(e)[:300]}")


def out_of_vocabulary(tokens: list[int], vocab_size: int | None) -> str | None:
    """Why `tokens` cannot be embedded by a model of `vocab_size` entries (None: no limit known), or None."""
    if vocab_size is None or not tokens:
        return None
    top, low = max(tokens), min(tokens)
    if top < vocab_size and low >= 0:
        return None
    bad = top if top >= vocab_size else low
    return (f"token id {bad} is outside the model's vocabulary [0, {vocab_size}) (config.json vocab_size): the "
            "tokenizer is larger than the model; use the model's own tokenizer (model.tokenizer)")
