"""Scored rows: a row with `continuation` (a text, or a list of texts) or `continuation_token_ids` (a list of ids, or
a list of such lists) is scored, not sampled: each continuation gives one record with its tokens' logprobs given the
row's prompt (docs/records.md). The fields, their checks and how text continuations are tokenized live here.

Text continuations are tokenized as lm-evaluation-harness tokenizes a (context, continuation) pair for a causal
model: trailing whitespace of the context moves to the front of the continuation, then the context and the context
followed by the continuation are encoded alike (with the tokenizer's default special tokens, as every text prompt),
and the continuation is the whole's ids after as many ids as the context alone has.
"""

from __future__ import annotations

from typing import Any

from engine import SamplingConfig, scored_length_error, scored_sampling_error
from orchestrator.plan.rejection import Rejection, a_type

TEXT_FIELD = "continuation"
IDS_FIELD = "continuation_token_ids"


def is_scored(row: dict) -> bool:
    """The row asks for scores (it has a continuation field), so it is not sampled."""
    return row.get(TEXT_FIELD) is not None or row.get(IDS_FIELD) is not None


def row_continuations(row: dict) -> list[str] | list[list[int]] | Rejection:
    """A scored row's continuations: texts, or token id lists; or why they cannot be used (`bad_continuation`)."""
    if row.get(TEXT_FIELD) is not None and row.get(IDS_FIELD) is not None:
        return Rejection("bad_continuation", f"row has both {TEXT_FIELD!r} and {IDS_FIELD!r}; give one")
    if row.get(TEXT_FIELD) is not None:
        value = row[TEXT_FIELD]
        texts = [value] if isinstance(value, str) else value
        if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
            return Rejection("bad_continuation", f"field {TEXT_FIELD!r} is {a_type(value)}, not a text or a non-empty "
                                                 "list of texts")
        if any(not t for t in texts):
            return Rejection("bad_continuation", f"field {TEXT_FIELD!r} holds an empty text")
        return texts
    value = row[IDS_FIELD]
    lists = [value] if isinstance(value, list) and value and all(_is_int(t) for t in value) else value
    if (not isinstance(lists, list) or not lists
            or not all(isinstance(ids, list) and ids and all(_is_int(t) for t in ids) for ids in lists)):
        return Rejection("bad_continuation", f"field {IDS_FIELD!r} is not a non-empty list of token ids, or a "
                                             "non-empty list of such lists")
    return lists


def n_error(n: int) -> str | None:
    """Why a scored row cannot run with `sampling.n` samples per prompt, or None: one record per continuation."""
    return None if n == 1 else (f"bad_continuation: a row with a continuation is scored, one record per continuation; "
                                f"set sampling.n to 1 (it is {n}) or drop the continuation")


def scored_error(sampling: SamplingConfig) -> str | None:
    """Why a scored row cannot run with its `sampling` (the run's, its own overrides applied), or None: more than
    one sample per prompt, or a structured output (there is no completion to constrain). One line, starting with
    its reason (`bad_continuation: ...`)."""
    return n_error(sampling.n) or scored_sampling_error(sampling)


def continuations_error(context: list[int], continuations: list[list[int]]) -> str | None:
    """Why a scored row's tokenized context and continuations cannot be scored (a text continuation that encodes
    to no token of its own), or None; one line starting with its reason, as the engine says it."""
    return next((why for c in continuations
                 if (why := scored_length_error(len(context), len(context) + len(c))) is not None), None)


def new_tokens(continuations: list[list[int]]) -> int:
    """The tokens a scored row's sequences add to its context at most: its longest continuation and the one token
    drawn after it (the engine's usual end, dropped)."""
    return 1 + max(map(len, continuations))


def with_token_ids(ids: list[int], continuations: list[str] | list[list[int]]
                   ) -> tuple[list[int], list[list[int]]] | Rejection:
    """(context ids, continuations' ids) of a scored row whose prompt is given as token ids: its continuations must
    be token ids too (a text continuation is tokenized with its prompt's text, which such a row has not)."""
    if continuations and isinstance(continuations[0], str):
        return Rejection("bad_continuation", f"a text {TEXT_FIELD!r} is tokenized with its prompt's text; with "
                                             f"prompt token ids give {IDS_FIELD!r}")
    return ids, continuations  # type: ignore[return-value]


def encode_continuations(encode, text: str, continuations: list[str] | list[list[int]]
                         ) -> tuple[list[int], list[list[int]]]:
    """(context ids, each continuation's ids) of a scored row whose prompt is `text` (`encode(text) -> ids`): text
    continuations split as `encode_pair` splits them (the context is the same for each), token ids as given."""
    if continuations and isinstance(continuations[0], str):
        pairs = [encode_pair(encode, text, c) for c in continuations]
        return pairs[0][0], [c for _, c in pairs]
    return encode(text), [list(c) for c in continuations]


def batch_samples(num_continuations) -> int | None:
    """The records a batch gives, from its rows' continuation counts (0 for a sampled row), where that is not
    its rows times sampling.n: None when no row is scored; else one per continuation and one per sampled row
    (sampling.n is 1 in a plan that accepted a scored row: `scored_error`). BatchRecord.expected_samples."""
    counts = [int(k) for k in num_continuations]
    return sum(max(k, 1) for k in counts) if any(counts) else None


def samples_per_row(prompts, n: int) -> list[int]:
    """Records each row of a batch table gives: one per continuation of a scored row, else `n` (sampling.n)."""
    if "continuations" not in prompts.column_names:  # a plan older than scored rows in runs
        return [n] * prompts.num_rows
    return [len(c) if c else n for c in prompts.column("continuations").to_pylist()]


def sample_keys(prompts, n: int) -> list[tuple[str, int]]:
    """(prompt_id, generation_index) of each sample of a batch table, in its output's order: row by row, each
    row's samples (a scored row's continuations) in order."""
    return [(pid, g) for pid, k in zip(prompts.column("prompt_id").to_pylist(), samples_per_row(prompts, n))
            for g in range(k)]


def encode_pair(encode, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) of a text pair as lm-evaluation-harness splits them (module docstring);
    `encode(text) -> ids`."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
    whole = encode(context + continuation)
    context_ids = encode(context)
    return context_ids, whole[len(context_ids):]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
