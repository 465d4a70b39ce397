"""What the engine can hold: the one place for the context length, the pages a prompt needs and the rules a
request must meet. The engine, packing, sizing, tokenizing and the slice all call these. No JAX here."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import numpy as np

from engine.config import EngineConfig, SamplingConfig
from engine.kv.kv_groups import KVGroups

N = TypeVar("N")  # an int, or a numpy integer array (packing measures a whole corpus at once)


def max_seq_len(config: EngineConfig, max_position_embeddings: int | None, model: str = "the model") -> int:
    """Longest sequence (prompt plus completion) in tokens: engine.max_seq_len, else the model's context
    length (config.json's max_position_embeddings); `model` names the checkpoint in the error."""
    if config.max_seq_len is not None:
        return config.max_seq_len
    if max_position_embeddings is None:
        raise ValueError(f"{model}'s config.json has no max_position_embeddings; set engine.max_seq_len")
    return int(max_position_embeddings)


def pages_for(num_tokens: N, page_size: int) -> N:
    """Pages that hold `num_tokens` tokens (ceil)."""
    return -(-num_tokens // page_size)


def pages_needed(num_prompt_tokens: N, max_new_tokens: int, page_size: int, n: int = 1, scored: N | int = 0,
                 context_shared: bool = True, groups: KVGroups | None = None, step_tokens: int = 0) -> N:
    """Exact KV pages for one prompt and its `n` samples at full length: the samples share the prompt's full
    pages and each holds its own copy of the partial last one and its completion's pages.

    A scored row (`scored` 1; an array of 0/1 for many rows) is a context of `num_prompt_tokens` with `n`
    continuations of at most `max_new_tokens - 1` tokens each, plus the one token drawn after each: they share
    only the context's full pages before its last token (that token's logits score each continuation's first
    token, so the prefix cache never serves its page: engine/kv/prefix_cache.py), and only where the prefix cache
    serves them (`context_shared`, `scored_context_shared`); else each holds all its pages.

    With layer `groups` (engine/kv/kv_groups.py) that slide, the pages' worth of every layer they hold at most,
    rounded up: a sliding group holds, for each sequence, no more than its window and `step_tokens` (the most
    tokens one step computes or reserves for a sequence) span, and never more than one table would."""
    shared = (num_prompt_tokens - scored) // page_size
    if not context_shared:
        shared = shared * (1 - scored)  # scored rows share nothing; a sampled row's samples still fork
    table = shared + n * (pages_for(num_prompt_tokens + max_new_tokens, page_size) - shared)
    if groups is None or groups.windows == (None,):
        return table
    whole = pages_for(num_prompt_tokens + max_new_tokens, page_size)
    units = sum(table if w is None else
                np.minimum(table, n * np.minimum(whole, groups.window_pages(w, page_size, step_tokens)))
                for w in groups.windows)
    return groups.as_pages(units)


def scored_context_shared(config: EngineConfig, sampling: SamplingConfig) -> bool:
    """Whether the continuations of a scored row share its context's pages (and compute them once): the prefix
    cache serves a later continuation the context's full pages, unless it is off or every prompt token's logits
    are asked for (sampling.prompt_logprobs: each continuation computes its whole prompt; engine/kv/prefix_cache.py)."""
    return config.prefix_caching and sampling.prompt_logprobs is None


def scored_prefill_tokens(num_context_tokens: int, continuation_lengths: Sequence[int], page_size: int,
                          context_shared: bool = True) -> int:
    """The prompt tokens a scored row's sequences compute: every continuation, the context once, and per later
    continuation what the prefix cache does not serve it (the context after its shared full pages: its last
    partial page or its last token's page), or the whole context where nothing is shared."""
    shared = (num_context_tokens - 1) // page_size * page_size if context_shared else 0
    return (num_context_tokens + (len(continuation_lengths) - 1) * (num_context_tokens - shared)
            + sum(continuation_lengths))


def scored_length_error(num_context_tokens: int, num_prompt_tokens: int) -> str | None:
    """Why a scored request whose prompt of `num_prompt_tokens` is a context of `num_context_tokens` followed by a
    continuation cannot run, or None: each needs at least one token."""
    if 1 <= num_context_tokens < num_prompt_tokens:
        return None
    return (f"bad_continuation: a scored row needs a context and a continuation of at least one token each, "
            f"got {num_context_tokens} context and {num_prompt_tokens - num_context_tokens} continuation tokens")


def scored_sampling_error(sampling: SamplingConfig) -> str | None:
    """Why a scored request (a context and a continuation, Request.num_context_tokens) cannot run with `sampling`,
    or None: it has no completion, so nothing for a structured output to constrain."""
    spec = sampling.structured
    return None if spec is None else (f"bad_continuation: a scored row has no completion to constrain; drop "
                                      f"sampling.{spec[0]}")


def check_pool(config: EngineConfig, max_seq_len: int) -> None:
    """The KV pool must hold one sequence of the longest allowed length."""
    if config.max_pages * config.page_size < max_seq_len:
        raise ValueError(
            f"engine.max_pages={config.max_pages} pages of {config.page_size} tokens hold "
            f"{config.max_pages * config.page_size} tokens, less than one sequence of engine.max_seq_len="
            f"{max_seq_len}; raise engine.max_pages to at least {pages_for(max_seq_len, config.page_size)} or "
            f"lower engine.max_seq_len")


def length_error(num_prompt_tokens: int, max_new_tokens: int, max_seq_len: int) -> tuple[str, str] | None:
    """Why a prompt of this length cannot run, as (reason, detail): `empty_prompt`, or `too_long` (longer
    than the context with its completion); None when it can."""
    n, m = num_prompt_tokens, max_new_tokens
    if n == 0:
        return "empty_prompt", "empty prompt (0 tokens)"
    if n + m > max_seq_len:
        return "too_long", (f"prompt has {n} tokens; with sampling.max_new_tokens={m} it needs {n + m}, more than "
                            f"the engine's max context of {max_seq_len} tokens (engine.max_seq_len)")
    return None


def stop_ids_error(stop_token_ids: Sequence[int], vocab_size: int | None) -> str | None:
    """Why `sampling.stop_token_ids` cannot stop a sample of a model of `vocab_size` entries (None: no limit known),
    or None."""
    bad = [t for t in stop_token_ids if vocab_size is not None and not 0 <= t < vocab_size]
    return None if not bad else (f"sampling.stop_token_ids must lie in [0, {vocab_size}) (the model's vocab_size), "
                                 f"got {bad[0]}")


def validate_request(prompt_token_ids: Sequence[int], sampling: SamplingConfig, max_seq_len: int,
                     vocab_size: int, has_tokenizer: bool, num_context_tokens: int | None = None,
                     image_token_id: int | None = None) -> str | None:
    """Why a request cannot run on the engine, or None; the message starts with the reason a run writes to
    rejected.jsonl (`too_long: ...`) where there is one. `num_context_tokens`: a scored request's context
    (Request), whose sequence is its prompt (context and continuation) and one token drawn after it.
    `image_token_id`: a multimodal checkpoint's image placeholder, which the engine (a text model) cannot fill."""
    if num_context_tokens is not None and (error := scored_length_error(num_context_tokens,
                                                                        len(prompt_token_ids))) is not None:
        return error
    new_tokens = 1 if num_context_tokens is not None else sampling.max_new_tokens
    if (error := length_error(len(prompt_token_ids), new_tokens, max_seq_len)) is not None:
        return f"{error[0]}: {error[1]}"
    if any(not 0 <= t < vocab_size for t in prompt_token_ids):
        return f"out_of_vocabulary: prompt token ids must lie in [0, {vocab_size}) (the model's vocab_size)"
    if image_token_id is not None and image_token_id in prompt_token_ids:
        return (f"image_input: the prompt holds the image token {image_token_id}; pagefleet runs the text model of "
                "this multimodal checkpoint only: send text prompts")
    if (why := stop_ids_error(sampling.stop_token_ids, vocab_size)) is not None:
        return f"out_of_vocabulary: {why}"
    if sampling.stop and not has_tokenizer:
        return "sampling.stop needs a tokenizer to decode text, and the model directory has none"
    return None
