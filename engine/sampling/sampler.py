"""Device-side token sampling and the per-sample random stream.

Two halves, so that a sample never depends on the batch or slot it ran in:

* host: `sample_base_key(seed, prompt_id, generation_index)` hashes the sample's identity into a
  threefry key (`u32[2]`), computed once per sample and carried in the step inputs;
* device: `position_keys(base, positions)` folds in the absolute position of the token being
  generated, and `sample(logits, ...)` draws one token per row from its own key.

Every row is independent: its token depends only on its logits, its own sampling parameters and its
own key, never on the other rows, the batch size or the row index.
"""

from __future__ import annotations

import hashlib
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

KEY_IMPL = "threefry2x32"
"""PRNG implementation of every sampling key, named explicitly so that `jax_default_prng_impl`
cannot change the samples."""

_KEY_DOMAIN = b"pagefleet.sample_key.v1"
"""Domain tag of the base-key hash; bump the version if the derivation ever changes."""


def sample_base_key(seed: int, prompt_id: str, generation_index: int) -> np.ndarray:
    """The sample's base key data: `u32[2]`, a pure function of (seed, prompt_id, generation_index).

    Derivation (stable across processes, hosts and Python versions; not Python's `hash()`):
    `digest = blake2b(message, digest_size=8)` with
    `message = b"pagefleet.sample_key.v1" + b"\\0" + str(seed) + b"\\0" + str(generation_index)
    + b"\\0" + prompt_id.encode("utf-8")` (integers as ASCII decimals; `prompt_id` last, so the
    encoding is unambiguous), and the key data is the digest read as two little-endian uint32 words.
    The result is raw threefry2x32 key data for `position_keys`.
    """
    if generation_index < 0:
        raise ValueError(f"generation_index must be >= 0, got {generation_index}")
    message = b"\0".join(
        (_KEY_DOMAIN, str(int(seed)).encode("ascii"), str(int(generation_index)).encode("ascii"),
         prompt_id.encode("utf-8"))
    )
    digest = hashlib.blake2b(message, digest_size=8).digest()
    return np.frombuffer(digest, dtype="<u4").astype(np.uint32)  # u32[2]


def position_keys(base: jax.Array, positions: jax.Array) -> jax.Array:
    """Per-row typed keys `key<threefry2x32>[S]` for the tokens about to be generated.

    `base: u32[S, 2]` is each row's `sample_base_key`; `positions: i32[S]` is the absolute index,
    in the whole sequence (prompt included), of the token being generated. Row i's key is
    `fold_in(wrap_key_data(base[i], impl="threefry2x32"), positions[i])`, so it depends on
    (seed, prompt_id, generation_index, position) alone. Jittable.
    """

    def one(base_row: jax.Array, position: jax.Array) -> jax.Array:
        return jax.random.fold_in(jax.random.wrap_key_data(base_row, impl=KEY_IMPL), position)

    return jax.vmap(one)(base.astype(jnp.uint32), positions.astype(jnp.int32))


def sample_key(seed: int, prompt_id: str, generation_index: int, position: int) -> jax.Array:
    """The typed key (scalar `key<threefry2x32>`) of one token: both halves composed, for tests
    and host-side callers. Equal to row i of `position_keys` for the same identity and position."""
    base = jnp.asarray(sample_base_key(seed, prompt_id, generation_index))[None]  # u32[1, 2]
    return position_keys(base, jnp.asarray([position], dtype=jnp.int32))[0]


def sample(
    logits: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    keys: jax.Array,
    truncation: bool = True,
    min_p: jax.Array | None = None,
    raw_logits: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Draw one token per row; returns `(tokens: i32[S], logprobs: f32[S])`. Pure and jittable.

    `truncation=False` (static) promises that no sampled row truncates (top_k off, top_p 1, min_p 0): the
    program then leaves out the top-k/top-p sort, with the same results.

    Inputs (S rows, V vocabulary entries), each row with its own settings:
      logits:      f32[S, V]  the model's logits for the next token
      temperature: f32[S]     0 means greedy; otherwise logits are divided by it
      top_k:       i32[S]     keep the k most likely tokens; 0 (or >= V) is off
      top_p:       f32[S]     nucleus mass in (0, 1]; 1 is off
      keys:        key[S] typed keys (from `position_keys`) or raw threefry key data u32[S, 2]
      min_p:       f32[S]     (optional) keep tokens of probability >= min_p * the top probability; 0 is off
      raw_logits:  f32[S, V]  (optional) the model's logits when `logits` are penalized (`penalize`): the
                              logprobs are read from them

    Semantics per row:
      * temperature == 0: the argmax of `logits` (ties go to the lowest index, like torch.argmax);
        top_k, top_p and the key are ignored.
      * temperature > 0: `logits / temperature`, then min-p (vLLM's: tokens whose probability under
        `softmax(logits / temperature)` is below `min_p` times the largest are dropped), then top-k, then
        top-p on the distribution left by top-k (the smallest set of most likely tokens whose cumulative
        probability is >= top_p; the most likely token is always kept), then a draw with
        `jax.random.categorical` from the row's key. Ties in the ranking are broken by the lowest token index.

    `logprobs[i]` is the log-probability of the chosen token under the raw model distribution,
    `log_softmax(raw_logits[i])` (default `logits`) at temperature 1 with no truncation or penalty, whatever
    the row's settings: the number to compare with Hugging Face's `log_softmax(logits)`.

    A row's result depends only on that row's inputs (never on S, the row's index or the other
    rows), which is what makes samples independent of how prompts were batched.
    """
    logits = logits.astype(jnp.float32)
    if not jax.dtypes.issubdtype(keys.dtype, jax.dtypes.prng_key):
        keys = jax.random.wrap_key_data(keys.astype(jnp.uint32), impl=KEY_IMPL)
    vocab_size = logits.shape[-1]
    raw = logits if raw_logits is None else raw_logits.astype(jnp.float32)
    logprobs_all = raw_logprobs(raw)  # f32[S, V]
    greedy_tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # i32[S]
    sampled_rows = temperature > 0  # bool[S]
    # A greedy row still flows through the sampled branch; divide by 1 there to keep it finite.
    scaled = logits / jnp.where(sampled_rows, temperature, 1.0)[:, None]  # f32[S, V]
    truncates = sampled_rows & (((top_k > 0) & (top_k < vocab_size)) | (top_p < 1.0))  # bool[S]
    if min_p is not None:  # static: a program for rows without min_p leaves it out
        truncates = truncates | (sampled_rows & (min_p > 0))

    # Batch-level fast paths (the full-vocabulary sort is most of a decode step): skip sampling when
    # every row is greedy, and skip the sort when no row truncates. The draw is made in vocabulary order
    # in every case (truncation only masks), so a row's token never depends on which path its batch took.
    def draw() -> jax.Array:
        masked = scaled if not truncation else jax.lax.cond(
            jnp.any(truncates), lambda: jax.vmap(partial(_truncate_row, with_min_p=min_p is not None))(
                scaled, top_k, top_p, jnp.zeros_like(top_p) if min_p is None else min_p), lambda: scaled)  # f32[S, V]
        return jax.vmap(jax.random.categorical)(keys, masked).astype(jnp.int32)

    sampled_tokens = jax.lax.cond(jnp.any(sampled_rows), draw, lambda: greedy_tokens)  # i32[S]
    tokens = jnp.where(sampled_rows, sampled_tokens, greedy_tokens)  # i32[S]
    logprobs = jnp.take_along_axis(logprobs_all, tokens[:, None], axis=-1)[:, 0]  # f32[S]
    return tokens, logprobs


def raw_logprobs(logits: jax.Array) -> jax.Array:
    """Log-probabilities `f32[S, V]` of the raw model distribution (temperature 1, no truncation or penalty): the
    one formula from logits to logprobs, for sampled tokens and scored prompt tokens alike."""
    return jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)


def score_tokens(logits: jax.Array, targets: jax.Array, num_top: int
                 ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Each row's given next token under the model: `(logprobs f32[Q], is_argmax bool[Q], top_ids i32[Q, num_top],
    top_logprobs f32[Q, num_top])` for `logits: f32[Q, V]` and `targets: i32[Q]`. `is_argmax`: the target is the
    argmax (ties go to the lowest index, like torch.argmax); the top tokens come most likely first, ties to the
    lowest index. `num_top` is static. Pure and jittable; a row depends on its own inputs alone."""
    logprobs = raw_logprobs(logits)  # f32[Q, V]
    chosen = jnp.take_along_axis(logprobs, targets[:, None], axis=-1)[:, 0]  # f32[Q]
    is_argmax = jnp.argmax(logits.astype(jnp.float32), axis=-1).astype(jnp.int32) == targets  # bool[Q]
    if num_top == 0:
        return chosen, is_argmax, jnp.zeros((logits.shape[0], 0), jnp.int32), jnp.zeros((logits.shape[0], 0), jnp.float32)
    top_logprobs, top_ids = jax.lax.top_k(logprobs, num_top)  # [Q, num_top]
    return chosen, is_argmax, top_ids.astype(jnp.int32), top_logprobs


def greedy_sample(logits: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`sample` for rows that are all greedy (temperature 0): `(argmax tokens i32[S], their raw logprobs f32[S])`,
    the same values `sample` gives each such row, without the sampling machinery in the program."""
    logits = logits.astype(jnp.float32)
    tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # ties go to the lowest index
    logprobs = jnp.take_along_axis(raw_logprobs(logits), tokens[:, None], axis=-1)[:, 0]
    return tokens, logprobs


def _truncate_row(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array, min_p: jax.Array,
                  with_min_p: bool = False) -> jax.Array:
    """One row's logits with tokens below min-p (when `with_min_p`, static), then outside top-k, then outside
    the top-p nucleus, set to -inf: `f32[V]`."""
    vocab_size = scaled.shape[-1]
    if with_min_p:  # as vLLM applies it, before top-k/top-p: probabilities under the whole (scaled) distribution
        probs_all = jax.nn.softmax(scaled)  # f32[V]
        scaled = jnp.where(probs_all < min_p * jnp.max(probs_all), -jnp.inf, scaled)
    # One stable sort gives both truncations; rank r holds the (r+1)-th most likely token.
    order = jnp.argsort(scaled, descending=True, stable=True)  # i32[V]
    sorted_logits = scaled[order]  # f32[V]
    ranks = jnp.arange(vocab_size)  # i32[V]

    k = jnp.where((top_k <= 0) | (top_k > vocab_size), vocab_size, top_k)
    keep = ranks < k  # bool[V]
    sorted_logits = jnp.where(keep, sorted_logits, -jnp.inf)

    probs = jax.nn.softmax(sorted_logits)  # f32[V], renormalised over the top-k survivors
    mass_before = jnp.cumsum(probs) - probs  # f32[V] probability of strictly more likely tokens
    # Keep a token while the tokens ranked above it hold less than top_p; rank 0 always stays.
    # top_p >= 1 keeps everything even when rounding makes the cumulative sum reach 1 early.
    in_nucleus = (mass_before < top_p) | (top_p >= 1.0) | (ranks == 0)
    kept = jnp.zeros(vocab_size, bool).at[order].set(keep & in_nucleus)  # back to vocabulary order
    return jnp.where(kept, scaled, -jnp.inf)


def penalty_state(history: jax.Array, prompt_lens: jax.Array, vocab_size: int) -> tuple[jax.Array, jax.Array]:
    """What the penalties read, from each row's tokens so far: `(in_prompt: bool[S, V], counts: i32[S, V])`, whether
    a token is in the row's prompt and how often its completion holds it. `history: i32[S, L]` is the row's prompt
    then generated tokens, padded with -1; `prompt_lens: i32[S]` its prompt length. Jittable."""
    S, L = history.shape
    rows = jnp.broadcast_to(jnp.arange(S)[:, None], (S, L))
    known = history >= 0
    in_prompt_cols = jnp.arange(L)[None, :] < prompt_lens[:, None]
    prompt_ids = jnp.where(known & in_prompt_cols, history, vocab_size)  # out of range: dropped
    generated_ids = jnp.where(known & ~in_prompt_cols, history, vocab_size)
    in_prompt = jnp.zeros((S, vocab_size), bool).at[rows, prompt_ids].set(True, mode="drop")
    counts = jnp.zeros((S, vocab_size), jnp.int32).at[rows, generated_ids].add(1, mode="drop")
    return in_prompt, counts


def penalize(logits: jax.Array, in_prompt: jax.Array, counts: jax.Array, repetition: jax.Array,
             presence: jax.Array, frequency: jax.Array) -> jax.Array:
    """Logits `f32[S, V]` with each row's penalties applied as vLLM applies them (`repetition: f32[S]`, 1 off;
    `presence`, `frequency: f32[S]`, 0 off): a token in the prompt or the completion has its logit divided by
    `repetition` when positive and multiplied by it otherwise (transformers' RepetitionPenaltyLogitsProcessor),
    then `frequency * count + presence * (count > 0)` is subtracted, `count` being its occurrences in the
    completion. Jittable."""
    logits = logits.astype(jnp.float32)
    seen = in_prompt | (counts > 0)
    rep = repetition[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    return logits - frequency[:, None] * counts - presence[:, None] * (counts > 0)
