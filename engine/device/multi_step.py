"""Multi-step decode: up to `engine.decode_steps` decode steps of the running rows in one device call, each row
stopping on the device at a stop id or its limit, and the chained call that continues those rows before the
host has read the first (pipelined decode). `ModelRunner` (engine/device/runner.py) makes these calls
(`MultiStepCalls`); the scheduler decides them (engine/scheduling/scheduler_output.py's DecodeCall)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from engine.models.axes import PAGE_SLOT
from engine.sizing.capacity import pages_for
from engine.device.device_calls import bucket, host_arrays, min_tokens_arrays, pick_rows, replicated, settle
from engine.models.model import StepSettings, Transformer
from engine.scheduling.scheduler_output import RunnerOutput
# Bound here and in engine/device/runner.py: tests patch `_sampling_mode` in both to force a sampling program.
from engine.sampling.row_sampling import RowSampling, sampling_arrays as _sampling_arrays, sampling_mode as _sampling_mode
from engine.device.step_inputs import StepInputs, group_pages, token_slots


@dataclass(frozen=True)
class DecodeRow:
    """One decoding sequence of a multi-step call: it feeds its last token and may run `limit` steps."""

    token_id: int  # the sequence's last token, not yet in the cache
    start: int  # its position = tokens of this sequence already in the cache
    # The sequence's pages in each KV layer group (`group_pages`: a flat list for one group), each list covering at
    # least start + limit tokens; kv_groups.NONE for a page slid out of its group's window.
    pages: Sequence[Sequence[int]] | Sequence[int]
    limit: int  # most decode steps this row may take (>= 1)
    sampling: RowSampling  # position = start + 1, the index of the first token it generates


def _forward_sample_steps(model: Transformer, pool, settings: StepSettings, num_steps: int, mode: str,
                          token_ids, starts, limits, page_indices, num_seqs, temperature, top_k, top_p, min_p, base_keys,
                          stop_ids, penalties=None, min_tokens=None):
    """Up to `num_steps` decode steps in one call; each row stops on the device at a stop id or its limit.

    Row s feeds token_ids[s] (i32[S]) at position starts[s] in step 0 and its own last token after that;
    it takes at most limits[s] steps (0 for padding rows) and stops after a token in stop_ids[s]
    (i32[S, E], padded with -1). A done row writes no more KV; the loop ends when every row is done.
    Step i is the single decode step for the same tokens: same inputs, same 1-query attention, same key
    (the generated token's position), so the tokens are those of `num_steps` single steps.
    page_indices (i32[G, S, P]) holds each row's pages in every KV layer group, as StepInputs does.
    Penalties (`penalties`, None unless the mode penalizes) count each step's new token before the next step,
    as the single steps' token histories would; `min_tokens` (None unless the mode has it) holds stop ids back by
    each step's own position, as single steps would. Returns tokens i32[K, S] and logprobs f32[K, S] (entries past a
    row's steps are junk), steps i32[S] and the rows' completion token counts i32[S, V] after the call (None
    without penalties), from which a chained call goes on.
    """
    S = token_ids.shape[0]
    page_size = pool.axis_size(PAGE_SLOT)
    rows = jnp.arange(S, dtype=jnp.int32)
    present = rows < num_seqs[0]
    cu_q_lens = jnp.minimum(jnp.arange(S + 1, dtype=jnp.int32), num_seqs[0])  # one query a row; padding rows empty
    logits_indices = jnp.where(present, rows, 0)

    def running(carry) -> jax.Array:
        i, _, _, done, _, _, _, _ = carry
        return (i < num_steps) & ~jnp.all(done)

    def one_step(carry):
        i, pool, tokens, done, steps, out_tokens, out_logprobs, counts = carry
        active = ~done
        # A done row repeats its last position (its write is dropped, its token ignored): every index stays
        # inside the pages it was given.
        positions = starts + jnp.minimum(i, jnp.maximum(limits - 1, 0))  # i32[S]
        slots = jnp.where(active, token_slots(page_indices, rows, positions, page_size),
                          settings.num_pages * page_size)  # i32[G, S]
        # The CPU kernel skips a row with no keys: a done row's attention (its token is ignored) costs nothing.
        kv_lens = jnp.where(present & (active | (settings.impl != "cpu_kernel")), positions + 1, 0)
        inputs = StepInputs(tokens, positions, slots, cu_q_lens, kv_lens, page_indices, num_seqs, logits_indices,
                            present)  # a decode row feeds a token it generated
        pool, logits = model(pool, inputs, settings)
        step_penalties = None if penalties is None else (penalties[0], counts, *penalties[2:])
        new, logprobs = pick_rows(settings, logits.array, mode, temperature, top_k, top_p, min_p, base_keys,
                                  positions + 1, step_penalties, None, min_tokens)
        if penalties is not None:  # the new token joins its row's completion for the next step
            counts = counts.at[rows, new].add(active.astype(jnp.int32))
        steps = steps + active.astype(jnp.int32)
        stopped = jnp.any(new[:, None] == stop_ids, axis=1)
        done = done | (active & (stopped | (steps >= limits)))
        return (i + 1, pool, jnp.where(active, new, tokens), done, steps, out_tokens.at[i].set(new),
                out_logprobs.at[i].set(logprobs), counts)

    carry = (jnp.int32(0), pool, token_ids, limits <= 0, jnp.zeros(S, jnp.int32),
             jnp.zeros((num_steps, S), jnp.int32), jnp.zeros((num_steps, S), jnp.float32),
             None if penalties is None else penalties[1])
    _, pool, _, _, steps, out_tokens, out_logprobs, counts = jax.lax.while_loop(running, one_step, carry)
    mesh = settings.mesh
    return (pool, replicated(out_tokens, mesh), replicated(out_logprobs, mesh), replicated(steps, mesh),
            counts)


def stopped_at_a_stop_id(xp, tokens, steps, stop_ids):
    """(last token i32[S], stopped bool[S]) of a multi-step call's rows: row s stopped at a stop id when its last
    token (tokens[steps[s] - 1, s]; junk where steps[s] is 0) is one of stop_ids[s]. `xp`: numpy on the host,
    jax.numpy on the device."""
    last = tokens[xp.maximum(steps - 1, 0), xp.arange(steps.shape[0])]
    return last, (steps > 0) & xp.any(last[:, None] == stop_ids, axis=1)


def _chained_inputs(tokens, steps, token_ids, starts, remaining, limits, live, stop_ids, num_steps: int):
    """The inputs of the multi-step call that continues the rows of one not yet read by the host: each row
    feeds its last token at its next position, and takes min(num_steps, its remaining tokens) steps unless
    it stopped on the device (a stop id: then `steps < limits`, or its last token is one), ran out, was
    already done, or the host finished it (`live` false). Done rows take 0 steps: no KV is written."""
    last, stopped = stopped_at_a_stop_id(jnp, tokens, steps, stop_ids)
    last = jnp.where(steps > 0, last, token_ids)
    remaining = remaining - steps
    limits = jnp.where(live & (limits > 0) & ~stopped, jnp.minimum(num_steps, remaining), 0)
    return last, starts + steps, remaining, limits


# Module-level, so every runner with the same model structure and shapes reuses compiled programs.
_steps_sample = jax.jit(_forward_sample_steps, donate_argnums=(1,), static_argnums=(2, 3, 4))
_chain = jax.jit(_chained_inputs, static_argnums=(8,))


@dataclass(frozen=True)
class PendingSteps:
    """A multi-step call dispatched and not yet read: its device outputs, and what a call continuing its
    rows needs (`ModelRunner.chain_multi_step`)."""
    tokens: jax.Array  # i32[K, S]
    logprobs: jax.Array  # f32[K, S]
    steps: jax.Array  # i32[S]
    token_ids: jax.Array | np.ndarray  # the call's inputs, i32[S]
    starts: jax.Array | np.ndarray
    limits: jax.Array | np.ndarray
    remaining: jax.Array | np.ndarray  # tokens each row may still generate from this call's start on
    mode: str
    sampling: tuple  # _sampling_arrays of the rows
    stops: np.ndarray
    num_rows: int
    penalties: tuple | None = None  # the call's `penalties`, counts as they were after it
    min_tokens: tuple | None = None  # the call's `min_tokens` (device_calls.min_tokens_arrays)


class MultiStepCalls:
    """ModelRunner's multi-step calls: they use its model, KV pool and groups, clock, transfer ledger, step settings,
    `decode_bucket` and `_penalties`."""

    def dispatch_multi_step(self, rows: Sequence[DecodeRow], stop_ids: Sequence[int], num_steps: int,
                            remaining: Sequence[int] | None = None) -> PendingSteps:
        """Start up to `num_steps` decode steps of the rows in one device call, stopping rows at `stop_ids`
        or their limits, without waiting for it (`fetch_multi_step` reads it). Row r's KV is written for
        positions start .. start + steps - 1. `remaining[r]` (default: the row's limit) is how many tokens
        row r may generate in this call and any call chained to it."""
        ps = self.config.page_size
        S = self.decode_bucket(len(rows))
        pad = S - len(rows)
        for r, row in enumerate(rows):
            end = row.start + row.limit
            num_pages = len(group_pages(row.pages, self.kv_groups.num_groups)[0])
            if (row.limit < 1 or end > self.max_seq_len or pages_for(end, ps) > num_pages
                    or row.sampling.position != row.start + 1):
                raise ValueError(f"decode row {r}: {row.limit} steps from position {row.start} with {num_pages} "
                                 f"pages (page_size {ps}, max_seq_len {self.max_seq_len})")
        # E is fixed per engine (one compile) unless rows bring stop ids of their own (sampling.stop_token_ids). A row
        # that ignores EOS stops at its own alone.
        row_stops = [sorted(set(() if row.sampling.ignore_eos else stop_ids) | set(row.sampling.stop_token_ids))
                     for row in rows]
        stops = np.full((S, bucket(max([len(stop_ids), *map(len, row_stops)]), 4)), -1, np.int32)
        for r, ids in enumerate(row_stops):
            stops[r, :len(ids)] = ids
        limits = [row.limit for row in rows]
        remaining = limits if remaining is None else list(remaining)
        mode = _sampling_mode([row.sampling for row in rows], self.model.config.vocab_size)
        sampling = _sampling_arrays([row.sampling for row in rows], S)
        per_row = (np.array([row.token_id for row in rows] + [0] * pad, np.int32),
                   np.array([row.start for row in rows] + [0] * pad, np.int32),
                   np.array(limits + [0] * pad, np.int32), np.array(remaining + [0] * pad, np.int32))
        # Placed as a chained call's are (the device outputs of _chain: replicated over the mesh): numpy arguments
        # would be another jit signature, and so a second compile of the same program (and of _chain's). Every
        # host builds the same rows; no cross-host check (device_put would make one on every call).
        mesh = self._settings.mesh
        placement = self.kv.pool.array.sharding if mesh is None else NamedSharding(mesh, P())
        with self.clock.timing(), self.transfers.sending(step_inputs=per_row):
            per_row = tuple(jax.make_array_from_process_local_data(placement, x) for x in per_row)
            penalties = self._penalties([row.sampling for row in rows], S, mode)
        held = min_tokens_arrays([row.sampling for row in rows], S, mode, stop_ids)
        return self._launch(*per_row, mode, sampling, stops, len(rows), [row.pages for row in rows], num_steps,
                            penalties, held)

    def chain_multi_step(self, prev: PendingSteps, pages: Sequence[Sequence[int]], num_steps: int) -> PendingSteps:
        """Dispatch the call that continues `prev`'s rows from its device outputs, before the host has read
        them: the host's work on `prev`'s tokens then overlaps this call. `pages[r]` (as `DecodeRow.pages`) must
        cover row r's position after `prev` plus `min(num_steps, remaining)` (the scheduler reserves both calls'
        pages at once); an empty `pages[r]` makes row r take no steps (the host finished it)."""
        S = prev.steps.shape[0]
        live = np.zeros(S, bool)
        live[:len(pages)] = [len(group_pages(p, self.kv_groups.num_groups)[0]) > 0 for p in pages]
        with self.clock.timing(), self.transfers.sending(step_inputs=live, sampling=prev.stops):
            token_ids, starts, remaining, limits = _chain(prev.tokens, prev.steps, prev.token_ids, prev.starts,
                                                          prev.remaining, prev.limits, live, prev.stops, num_steps)
        return self._launch(token_ids, starts, limits, remaining, prev.mode, prev.sampling, prev.stops,
                            prev.num_rows, pages, num_steps, prev.penalties, prev.min_tokens)

    def _launch(self, token_ids, starts, limits, remaining, mode: str, sampling: tuple, stops: np.ndarray,
                num_rows: int, pages: Sequence[Sequence[int]], num_steps: int,
                penalties: tuple | None = None, min_tokens: tuple | None = None) -> PendingSteps:
        G = self.kv_groups.num_groups
        page_array = np.zeros((G, stops.shape[0], self.pages_per_seq), np.int32)
        for r, row_pages in enumerate(pages):
            for g, group in enumerate(group_pages(row_pages, G)):
                page_array[g, r, :len(group)] = group
        np.maximum(page_array, 0, out=page_array)  # NONE: page 0, never read (StepInputs.page_indices)
        num_seqs = np.array([num_rows], np.int32)
        with self.clock.timing(), self.transfers.sending(step_inputs=num_seqs, page_tables=page_array,
                                                         sampling=(*sampling, stops,
                                                                   *host_arrays(penalties, min_tokens))):
            self.kv.pool, tokens, logprobs, steps, counts = _steps_sample(
                self.model, self.kv.pool, self._settings, num_steps, mode, token_ids, starts, limits, page_array,
                num_seqs, *sampling, stops, penalties, min_tokens)
            settle(self.clock, (tokens, logprobs, steps, counts))
        after = None if penalties is None else (penalties[0], counts, *penalties[2:])
        return PendingSteps(tokens, logprobs, steps, token_ids, starts, limits, remaining, mode, sampling, stops,
                            num_rows, after, min_tokens)

    def fetch_multi_step(self, pending: PendingSteps) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Wait for a dispatched call: (tokens i32[num_steps, rows], logprobs f32[num_steps, rows],
        steps i32[rows]); row r's tokens are tokens[:steps[r], r]."""
        n = pending.num_rows
        with self.clock.timing():
            tokens, logprobs, steps = self.transfers.read(tokens=pending.tokens, logprobs=pending.logprobs,
                                                          steps=pending.steps)
            return tokens[:, :n], logprobs[:, :n], steps[:n]

    def read_multi_step(self, pending: PendingSteps) -> RunnerOutput:
        """`fetch_multi_step` as the scheduler reads it, with the rows the device stopped at a stop id (the last
        token a row took is one of its stop ids): the host must finish those, or it would wait on them forever."""
        tokens, logprobs, steps = self.fetch_multi_step(pending)
        _, stopped = stopped_at_a_stop_id(np, tokens, steps, pending.stops[:len(steps)])
        return RunnerOutput(tokens, logprobs, steps, stopped=stopped)
