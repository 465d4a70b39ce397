"""Checks a prompt's token ids need from the model, shared by planning (orchestrator.plan.tokenize) and
`pagefleet generate`, so both judge a row the same way and name the same reason: token ids the model has no
embedding for. (A chat its template cannot render: chat.render_chat.)
"""

from __future__ import annotations


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
