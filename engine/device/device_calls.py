"""What the runner's device calls share, single steps and multi-step calls alike: shape buckets, outputs pinned
for the host to read, and picking each row's token and logprob on the device."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from engine.models.model import StepSettings
from engine.device.row_tiles import by_row_tiles
from engine.sampling.sampler import greedy_sample, penalize, position_keys, raw_logprobs, sample, score_tokens

MIN_TOKEN_BUCKET = 16
MIN_SEQ_BUCKET = 4


def settle(clock, outputs) -> None:
    """Inside a call's timing: wait for its outputs when the clock asks for serial device time (DeviceClock.serial)."""
    if clock.serial:
        jax.block_until_ready(outputs)


def bucket(n: int, minimum: int) -> int:
    """Smallest power of two >= n (and >= minimum): the few shapes the step is compiled for."""
    return max(minimum, 1 << max(0, math.ceil(math.log2(max(n, 1)))))


def replicated(x: jax.Array, mesh: Mesh | None) -> jax.Array:
    """Pin an output the host reads to every device of the mesh: each host process then reads it from
    its own devices (no cross-host fetch, no leader), and never depends on the compiler's choice."""
    return x if mesh is None else jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P()))


def pick_rows(settings: StepSettings, logits: jax.Array, mode: str, *rows):
    """`pick` on tiles of `settings.sample_row_tile` rows (`row_tiles`): a row's logprob does not depend on
    how many rows the step samples."""
    return by_row_tiles(lambda logits, *rows: pick(logits, mode, *rows), settings.sample_row_tile, logits, *rows)


def score_rows(settings: StepSettings, logits: jax.Array, targets: jax.Array, num_top: int):
    """`score_tokens` on tiles of `settings.sample_row_tile` rows, as `pick_rows` samples: a scored token's bits do not
    depend on how many tokens the step scores."""
    return by_row_tiles(lambda logits, targets: score_tokens(logits, targets, num_top), settings.sample_row_tile,
                        logits, targets)


def score_inputs_of(cu_q_lens: np.ndarray, scoring, vocab_size: int) -> tuple | None:
    """(num_top, score_indices i32[Q], score_targets i32[Q]) of a step whose chunks score prompt tokens (`scoring[s]`,
    a runner.ScoreRequest, for chunk s of a step with these `cu_q_lens`), padded to a bucket (the K of the top tokens
    too), or None when none does."""
    q = sum(len(r.targets) for r in scoring)
    if q == 0:
        return None
    Q = bucket(q, MIN_TOKEN_BUCKET)
    indices, targets = np.zeros(Q, np.int32), np.zeros(Q, np.int32)
    i = 0
    for s, r in enumerate(scoring):
        m = len(r.targets)
        indices[i:i + m] = np.arange(cu_q_lens[s] + r.offset, cu_q_lens[s] + r.offset + m)
        targets[i:i + m] = r.targets
        i += m
    k = max(r.num_top for r in scoring)
    num_top = 0 if k == 0 else min(bucket(k, 1), vocab_size)
    return num_top, indices, targets


def allowed_logits(logits: jax.Array, mask: jax.Array) -> jax.Array:
    """`logits` f32[S, V] with every token the row's bitmask `mask` (i32[S, ceil(V / 32)], bit t % 32 of word
    t // 32) does not allow set to -inf: the constrained distribution's logits (structured outputs)."""
    bits = (mask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # i32[S, W, 32]
    allowed = bits.reshape(mask.shape[0], -1)[:, :logits.shape[-1]] != 0  # bool[S, V]
    return jnp.where(allowed, logits.astype(jnp.float32), -jnp.inf)


def pick(logits: jax.Array, mode: str, temperature, top_k, top_p, min_p, base_keys, positions, penalties=None,
         mask=None, min_tokens=None):
    """(tokens, logprobs) of `sample`, from a program with only what `mode` needs: for `greedy` the argmax
    alone, for `sample` no top-k/top-p sort, min-p only with `+min_p`, penalties only with `+penalties`
    (`penalties` = (in_prompt bool[S, V], counts i32[S, V], repetition, presence, frequency f32[S])), stop ids held
    back only with `+min_tokens` (`min_tokens`: `before_min_tokens`'s stop ids and ends). Each gives every row the
    token and logprob `sample` gives it; logprobs are the raw model's, penalties and min_tokens or not (vLLM's). `mask`
    (`+mask`: i32[S, W], `allowed_logits`) limits each row to the tokens its structured output allows: its
    logprobs are then those of that constrained distribution."""
    kind = mode.split("+")[0]
    if mask is not None:
        logits = allowed_logits(logits, mask)
    raw = logits
    if penalties is not None:
        logits = penalize(raw, *penalties)
    if min_tokens is not None:
        logits = before_min_tokens(logits, positions, *min_tokens)
    if kind == "greedy":
        if logits is raw:
            return greedy_sample(raw)
        tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        return tokens, jnp.take_along_axis(raw_logprobs(raw), tokens[:, None], axis=-1)[:, 0]
    return sample(logits, temperature, top_k, top_p, position_keys(base_keys, positions), truncation=kind == "truncate",
                  min_p=min_p if "+min_p" in mode else None, raw_logits=None if logits is raw else raw)


def before_min_tokens(logits: jax.Array, positions: jax.Array, stop_ids: jax.Array, ends: jax.Array) -> jax.Array:
    """`logits` f32[S, V] with each row's stop ids (`stop_ids` i32[S, E], padded with -1) at -inf while the token
    drawn at `positions` i32[S] comes before the row's `ends` i32[S] (its first position after sampling.min_tokens
    generated tokens), as vLLM's min_tokens holds them back. A row left without any finite logit (a structured output
    that can only end) keeps them, as vLLM restores them."""
    S, V = logits.shape
    early = (positions < ends)[:, None] & (stop_ids >= 0)
    ids = jnp.where(early, stop_ids, V)  # out of range: dropped
    held = jnp.zeros((S, V), bool).at[jnp.arange(S)[:, None], ids].set(True, mode="drop")
    kept = jnp.where(held, -jnp.inf, logits.astype(jnp.float32))
    return jnp.where(jnp.any(kept > -jnp.inf, axis=-1, keepdims=True), kept, logits.astype(jnp.float32))


def min_tokens_arrays(rows, size: int, mode: str, stop_ids) -> tuple[np.ndarray, np.ndarray] | None:
    """The `min_tokens` argument of a call whose mode holds stop ids back (None otherwise): each row's stop ids (the
    engine's `stop_ids` and its own, i32[size, E] padded with -1, E a bucket) and its end (RowSampling.min_tokens_end,
    i32[size]; 0 for padding rows)."""
    if "+min_tokens" not in mode:
        return None
    ids = [sorted(set(stop_ids) | set(r.stop_token_ids)) for r in rows]
    held = np.full((size, bucket(max(map(len, ids), default=1), 4)), -1, np.int32)
    for r, row_ids in enumerate(ids):
        held[r, :len(row_ids)] = row_ids
    return held, np.array([r.min_tokens_end for r in rows] + [0] * (size - len(rows)), np.int32)


def host_arrays(*arguments: tuple | None) -> tuple[np.ndarray, ...]:
    """The host arrays among a call's penalty and min_tokens arguments (its token state is on the device already)."""
    return tuple(a for group in arguments if group is not None for a in group if isinstance(a, np.ndarray))
