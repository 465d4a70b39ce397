"""The device side of a step: `ModelRunner.run(SchedulerOutput) -> RunnerOutput`.

The runner owns the model, the KV pool and the device calls, and makes no scheduling decisions: the
scheduler's output says which new tokens of which sequences to process, in which pages, and how many decode
steps a call may take; the runner pads them to a shape bucket, calls the jitted programs and returns the
sampled tokens, their logprobs and (for a multi-step call) each row's step count decided on the device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from engine.kernels.attention import resolve_attention_impl
from engine.sizing.capacity import pages_for
# Callers size shapes with `runner.bucket` and the MIN_* buckets (engine/sizing/preflight.py).
from engine.device.device_calls import (MIN_SEQ_BUCKET, MIN_TOKEN_BUCKET, bucket, host_arrays, min_tokens_arrays,
                                        pick_rows, replicated, score_inputs_of, score_rows, settle)
from engine.kv.kv_cache import KVCache
from engine.kv.kv_groups import KVGroups
from engine.models.model import StepSettings, Transformer, unstack_layers
from engine.device.multi_step import DecodeRow, MultiStepCalls, PendingSteps
from engine.device.runner_config import RunnerConfig
# Bound here and in engine/device/multi_step.py: tests patch `_sampling_mode` in both; callers build rows as
# `runner.RowSampling`.
from engine.sampling.row_sampling import RowSampling, sampling_arrays as _sampling_arrays
from engine.sampling.row_sampling import sampling_mode as _sampling_mode
from engine.sampling.sampler import penalty_state
from engine.sampling.structured import Constraint, mask_words
from engine.scheduling.scheduler_output import RunnerOutput, SchedulerOutput, ScoredTokens
from engine.stats import DeviceClock
from engine.device.step_inputs import SeqChunk, StepInputs, group_pages, token_slots
from engine.device.transfers import TransferLedger

# On the CPU, every matmul takes at least this many rows (StepSettings.min_matmul_rows) and sampling runs
# in tiles of exactly CPU_SAMPLE_ROW_TILE rows: XLA's CPU kernels round a row by the call's row count, and these
# keep each row's bits independent of the step around it (engine/device/row_tiles.py). Elsewhere 0: no rule.
CPU_MIN_MATMUL_ROWS = 64
CPU_SAMPLE_ROW_TILE = 8


@dataclass(frozen=True)
class ScoreRequest:
    """The prompt tokens one chunk scores: the logits of its token `offset + j` score `targets[j]` (the token after
    it), with the `num_top` most likely tokens at each."""

    offset: int
    targets: Sequence[int]
    num_top: int


def is_decode_only(chunks: Sequence[SeqChunk]) -> bool:
    """One new token per sequence: tokens are padded like sequences and attention uses 1-query tiles."""
    return all(len(c.token_ids) == 1 for c in chunks)


def _forward(model: Transformer, pool, inputs: StepInputs, settings: StepSettings):
    pool, logits = model(pool, inputs, settings)
    return pool, hax.named(replicated(logits.array, settings.mesh), logits.axes)


def _forward_sample(model: Transformer, pool, inputs: StepInputs, settings: StepSettings, mode: str,
                    temperature, top_k, top_p, min_p, base_keys, positions, penalties=None, min_tokens=None):
    """Forward and sample on the device: only tokens i32[S] and logprobs f32[S] come back to the host.
    `mode` (static, `_sampling_mode`) leaves out of the program what no row of the step needs; `penalties`
    (`_penalties`) and `min_tokens` (`min_tokens_arrays`) are None unless the mode has them."""
    pool, logits = model(pool, inputs, settings)
    tokens, logprobs = pick_rows(settings, logits.array, mode, temperature, top_k, top_p, min_p, base_keys, positions,
                                 penalties, None, min_tokens)
    return pool, replicated(tokens, settings.mesh), replicated(logprobs, settings.mesh)


def _forward_sample_score(model: Transformer, pool, inputs: StepInputs, settings: StepSettings, mode: str,
                          num_top: int, score_indices, score_targets, temperature, top_k, top_p, min_p, base_keys,
                          positions, penalties=None, min_tokens=None):
    """`_forward_sample`, and the step's scored prompt tokens: the logits of token rows `score_indices: i32[Q]` score
    `score_targets: i32[Q]` (`score_rows`). They run through the LM head with the sampled rows, so a scored row is
    computed as a sampled one is."""
    num_rows = inputs.logits_indices.shape[0]
    inputs = eqx.tree_at(lambda i: i.logits_indices, inputs,
                         jnp.concatenate([inputs.logits_indices, score_indices]))
    pool, logits = model(pool, inputs, settings)
    tokens, logprobs = pick_rows(settings, logits.array[:num_rows], mode, temperature, top_k, top_p, min_p, base_keys,
                                 positions, penalties, None, min_tokens)
    scores = score_rows(settings, logits.array[num_rows:], score_targets, num_top)
    return (pool, replicated(tokens, settings.mesh), replicated(logprobs, settings.mesh),
            tuple(replicated(x, settings.mesh) for x in scores))


def _pick_masked(settings: StepSettings, logits, mode: str, temperature, top_k, top_p, min_p, base_keys, positions,
                 penalties, mask, min_tokens=None):
    """The sampling half of `_forward_sample` for a step with structured outputs, on logits f32[S, V] already on
    the device: the host fills the rows' masks (i32[S, W]) while the forward pass runs."""
    tokens, logprobs = pick_rows(settings, logits, mode, temperature, top_k, top_p, min_p, base_keys, positions,
                                 penalties, mask, min_tokens)
    return replicated(tokens, settings.mesh), replicated(logprobs, settings.mesh)


def _score_only(settings: StepSettings, logits, targets, num_top: int):
    """`score_rows` of logits already on the device (a step with structured outputs computes its logits apart)."""
    return tuple(replicated(x, settings.mesh) for x in score_rows(settings, logits, targets, num_top))


# Module-level, so every runner with the same model structure and shapes reuses compiled programs.
_logits = jax.jit(_forward, donate_argnums=(1,), static_argnums=(3,))
_masked_pick = jax.jit(_pick_masked, static_argnums=(0, 2))
_score_logits = jax.jit(_score_only, static_argnums=(0, 3))
_step_sample = jax.jit(_forward_sample, donate_argnums=(1,), static_argnums=(3, 4))
_step_sample_score = jax.jit(_forward_sample_score, donate_argnums=(1,), static_argnums=(3, 4, 5))
_penalty_state = jax.jit(penalty_state, static_argnums=(2,))


def step_settings(config: RunnerConfig, groups: KVGroups, impl: str, mesh, platform: str) -> StepSettings:
    """The forward pass's static settings, for `platform`: one for every kind of step (decode-only or with prompt
    chunks), so that a row's bits do not depend on the kind of step it is computed in. One group leaves the layers'
    tables out (layer l at slot l of the one table: the program of a model without groups)."""
    cpu = platform == "cpu"
    layer_group, layer_slot = ((), ()) if groups.num_groups == 1 else (groups.layer_group, groups.layer_slot)
    return StepSettings(impl, config.attn_pages_per_block, config.attn_queries_per_block,
                        groups.units(config.max_pages), mesh, config.attn_tiles_per_group,
                        CPU_MIN_MATMUL_ROWS if cpu else 0, CPU_SAMPLE_ROW_TILE if cpu else 0, layer_group, layer_slot)


class ModelRunner(MultiStepCalls):
    def __init__(self, model: Transformer, config: RunnerConfig, max_seq_len: int, stop_ids: Sequence[int] = (),
                 mesh: Mesh | None = None, kv_dtype=jnp.float32) -> None:
        """`config`: `RunnerConfig.of(engine_config)`. `stop_ids`: the token ids that end a sample (EOS), checked
        on the device in multi-step calls."""
        platform = jax.default_backend()
        self.model = unstack_layers(model) if platform == "cpu" else model  # see unstack_layers
        self.config = config
        self.max_seq_len = max_seq_len
        self.stop_ids = sorted(stop_ids)
        self.pages_per_seq = pages_for(max_seq_len, config.page_size)  # page-table width
        self.transfers = TransferLedger()  # every read of a device output and every host input below goes through it
        self.kv_groups = KVGroups.of_layers(config.kv.groups, model.config.num_layers)
        self.kv = KVCache(model.config, self.kv_groups.units(config.max_pages), config.page_size, self.transfers,
                          kv_dtype, mesh, host_pages=config.kv.host_kv_pages, groups=self.kv_groups)
        self.clock = DeviceClock()  # every dispatch and every wait for outputs below is timed on it
        self.attention_impl = resolve_attention_impl(config.attention_impl, kv_dtype)  # "cpu_kernel": native kernels
        self._settings = step_settings(config, self.kv_groups, self.attention_impl, mesh, platform)
        self._ahead: PendingSteps | None = None  # the multi-step call dispatched ahead of the host's read

    def run(self, out: SchedulerOutput) -> RunnerOutput:
        """Run the device call the scheduler decided (see SchedulerOutput and DecodeCall): its swaps first (the
        page-outs read the pages before the step reuses them, and land in the host pool after it), then the call."""
        if out.swap_out[0] or out.swap_in[0] or out.swap_in_ahead[0] or self.kv.has_page_ins_ahead:
            with self.clock.timing():
                self.kv.land_page_ins()  # the last step's page-ins ahead: this step reads them
                self.kv.page_out(*out.swap_out)
                self.kv.page_in(*out.swap_in)
                self.kv.page_in_ahead(*out.swap_in_ahead)  # for the next step: the copy runs behind this one
        result = self._run(out)
        if out.swap_out[0]:
            with self.clock.timing():
                self.kv.finish_page_outs()
        return result

    def _run(self, out: SchedulerOutput) -> RunnerOutput:
        call = out.decode
        if call is None:
            self._ahead = None
            chunks = [SeqChunk(c.token_ids, c.start, c.pages, c.num_prompt_tokens) for c in out.chunks]
            scoring = [ScoreRequest(c.score_offset, c.score_targets, c.num_top) for c in out.chunks]
            tokens, logprobs, scores = self.step_sample(chunks, out.row_sampling, out.row_chunk, scoring)
            self.kv.copy_pages(*out.copies)  # forked siblings' partial last pages, written by this step
            return RunnerOutput(tokens, logprobs, scores=scores)
        if call.resume:
            pending = self._ahead
        else:
            rows = [DecodeRow(*row) for row in zip(call.token_ids, call.starts, call.pages, call.limits, call.sampling)]
            pending = self.dispatch_multi_step(rows, self.stop_ids, self.config.decode_steps, call.budgets)
        self._ahead = (None if call.chain_pages is None
                       else self.chain_multi_step(pending, call.chain_pages, self.config.decode_steps))
        return self.read_multi_step(pending)

    def reset(self, physical: bool) -> None:
        """Forget a call dispatched ahead; zero the pool when `physical`, or when a step that failed after
        donating the pool left it deleted (an abort)."""
        self._ahead = None
        if physical or self.kv.pool.array.is_deleted():
            self.kv.zero()  # dispatched page-outs are forgotten too
        else:
            self.kv.finish_page_outs()  # the prefix cache's host tier may outlive a settle
            self.kv.land_page_ins()

    def decode_bucket(self, n: int) -> int:
        """Rows of a decode-only step or a multi-step call for n sequences: a power of four, at most the
        steps with prompt chunks' max_seqs bucket. Half as many programs to compile as powers of two; an
        extra decode row costs little next to reading every weight once per step."""
        cap = bucket(self.config.max_seqs, MIN_SEQ_BUCKET)
        rows = MIN_SEQ_BUCKET
        while rows < n:
            rows *= 4
        return max(min(rows, cap), bucket(n, MIN_SEQ_BUCKET))

    def build_inputs(self, chunks: Sequence[SeqChunk], row_chunk: Sequence[int] | None = None) -> StepInputs:
        """Pack chunks into padded host arrays (see StepInputs for the layout).

        `row_chunk[r]` names the chunk whose last token's logits feed output row r (default: one row per
        chunk); several rows may read one chunk (the samples of one prompt).
        """
        ps, G = self.config.page_size, self.kv_groups.num_groups
        n_tokens = sum(len(c.token_ids) for c in chunks)
        # Decode-only steps (one token a sequence) pad tokens like sequences: no padding tiles in attention.
        # Steps with prompt chunks always take max_seqs sequence rows, so their compiled shapes vary in T
        # alone (a few programs, not one per (T, S) pair); attention skips the empty rows.
        decode_only = is_decode_only(chunks)
        S = self.decode_bucket(len(chunks)) if decode_only else bucket(self.config.max_seqs, MIN_SEQ_BUCKET)
        T = S if decode_only else bucket(n_tokens, MIN_TOKEN_BUCKET)
        token_ids = np.zeros(T, np.int32)
        positions = np.zeros(T, np.int32)
        prompt_ends = np.full(T, np.iinfo(np.int32).max, np.int32)  # each token's sequence's prompt length
        seq_rows = np.zeros(n_tokens, np.int32)  # each real token's sequence row
        cu = np.full(S + 1, n_tokens, np.int32)
        kv_lens = np.zeros(S, np.int32)
        pages = np.zeros((G, S, self.pages_per_seq), np.int32)  # NONE entries kept until the slots are computed
        last_of_chunk = np.zeros(len(chunks), np.int32)
        row = 0
        if decode_only:  # the common step on a fast device: filled from lists, not per-sequence numpy ops
            self._fill_decode(chunks, token_ids, positions, seq_rows, cu, kv_lens, pages, last_of_chunk)
            prompt_ends[:len(chunks)] = [c.prompt_end for c in chunks]
        for s, c in enumerate(() if decode_only else chunks):
            n = len(c.token_ids)
            end = c.start + n
            seq_pages = np.asarray(group_pages(c.pages, G), np.int32)  # [G, pages]
            if n == 0 or end > self.max_seq_len or pages_for(end, ps) > seq_pages.shape[1]:
                raise ValueError(f"chunk {s}: {n} tokens at position {c.start} with {seq_pages.shape[1]} pages "
                                 f"(page_size {ps}, max_seq_len {self.max_seq_len})")
            token_ids[row:row + n] = c.token_ids
            positions[row:row + n] = np.arange(c.start, end)
            prompt_ends[row:row + n] = c.prompt_end
            seq_rows[row:row + n] = s
            cu[s] = row
            kv_lens[s] = end
            pages[:, s, :seq_pages.shape[1]] = seq_pages
            row += n
            last_of_chunk[s] = row - 1
        slots = np.full((G, T), self.kv.num_pages * ps, np.int32)  # out of range: dropped
        slots[:, :n_tokens] = token_slots(pages, seq_rows, positions[:n_tokens], ps)
        if (slots < 0).any():
            g, t = np.argwhere(slots < 0)[0]
            raise ValueError(f"chunk {seq_rows[t]}: position {positions[t]} is in a page it no longer holds in KV "
                             f"layer group {g}")
        np.maximum(pages, 0, out=pages)  # NONE: page 0, never read (StepInputs.page_indices)
        row_chunk = list(range(len(chunks))) if row_chunk is None else list(row_chunk)
        last = np.zeros(max(S, bucket(len(row_chunk), MIN_SEQ_BUCKET)), np.int32)
        last[:len(row_chunk)] = last_of_chunk[row_chunk]
        return StepInputs(token_ids, positions, slots, cu, kv_lens, pages, np.array([len(chunks)], np.int32), last,
                          positions >= prompt_ends)

    def _fill_decode(self, chunks: Sequence[SeqChunk], token_ids: np.ndarray, positions: np.ndarray,
                     seq_rows: np.ndarray, cu: np.ndarray, kv_lens: np.ndarray, pages: np.ndarray,
                     last_of_chunk: np.ndarray) -> None:
        """build_inputs' arrays for chunks of one token each: chunk s is token row s."""
        ps, n, G = self.config.page_size, len(chunks), pages.shape[0]
        starts = [c.start for c in chunks]
        for s, (c, start) in enumerate(zip(chunks, starts)):
            seq_pages = group_pages(c.pages, G)
            if start + 1 > self.max_seq_len or start // ps >= len(seq_pages[0]):
                raise ValueError(f"chunk {s}: 1 token at position {start} with {len(seq_pages[0])} pages "
                                 f"(page_size {ps}, max_seq_len {self.max_seq_len})")
            for g, group in enumerate(seq_pages):
                pages[g, s, :len(group)] = group
        token_ids[:n] = [c.token_ids[0] for c in chunks]
        positions[:n] = starts
        seq_rows[:] = cu[:n] = last_of_chunk[:] = range(n)
        kv_lens[:n] = [start + 1 for start in starts]

    def logits(self, chunks: Sequence[SeqChunk]) -> np.ndarray:
        """Process the chunks; returns f32[len(chunks), vocab] logits of each chunk's last token. Not the
        engine's path (it samples on the device): for checks against a reference model and step timings."""
        inputs = self.build_inputs(chunks)  # host arrays: the jitted call copies them (cheaper than jnp.asarray)
        with self.clock.timing():
            with self.transfers.sending(**_sent(inputs)):
                self.kv.pool, logits = _logits(self.model, self.kv.pool, inputs, self._settings)
                settle(self.clock, logits.array)
            return self.transfers.read(logits=logits.array)[0][:len(chunks)]  # the local replica, sliced on the host

    def logits_on_device(self, inputs: StepInputs, chunks: Sequence[SeqChunk]) -> jax.Array:
        """The logits program alone, on inputs already on the device, with nothing copied or timed around it: the
        benchmarking hook benchmarks/step_bench.py times the device with (`logits` is the host-side path)."""
        self.kv.pool, logits = _logits(self.model, self.kv.pool, inputs, self._settings)
        return logits.array

    def step_sample(self, chunks: Sequence[SeqChunk], rows: Sequence[RowSampling],
                    row_chunk: Sequence[int] | None = None, scoring: Sequence[ScoreRequest] = ()
                    ) -> tuple[np.ndarray, np.ndarray, ScoredTokens | None]:
        """Process the chunks and pick a next token per row: (tokens i32[rows], logprobs f32[rows], the tokens
        `scoring[s]` asks chunk s to score, or None when none does)."""
        inputs = self.build_inputs(chunks, row_chunk)
        S = inputs.logits_indices.shape[0]
        positions = np.array([r.position for r in rows] + [0] * (S - len(rows)), np.int32)
        mode, sampling = _sampling_mode(rows, self.model.config.vocab_size), _sampling_arrays(rows, S)
        n = len(rows)
        score_inputs = score_inputs_of(inputs.cu_q_lens, scoring, self.model.config.vocab_size)
        if "+mask" in mode:
            return self._step_sample_masked(chunks, inputs, rows, mode, sampling, positions, score_inputs,
                                            sum(len(r.targets) for r in scoring))
        with self.clock.timing():
            penalties, held = self._penalties(rows, S, mode), min_tokens_arrays(rows, S, mode, self.stop_ids)
            with self.transfers.sending(**_sent(inputs), sampling=(*sampling, positions, *host_arrays(penalties, held)),
                                        scoring=score_inputs[1:] if score_inputs else ()):
                settings = self._settings
                if score_inputs is None:
                    self.kv.pool, tokens, logprobs = _step_sample(self.model, self.kv.pool, inputs, settings, mode,
                                                                  *sampling, positions, penalties, held)
                    scores = ()
                else:
                    self.kv.pool, tokens, logprobs, scores = _step_sample_score(
                        self.model, self.kv.pool, inputs, settings, mode, *score_inputs, *sampling, positions,
                        penalties, held)
                settle(self.clock, (tokens, logprobs, scores))
            tokens, logprobs = self.transfers.read(tokens=tokens, logprobs=logprobs)
            if score_inputs is None:
                return tokens[:n], logprobs[:n], None
            q = sum(len(r.targets) for r in scoring)
            read = [self.transfers.read(prompt_logprobs=x)[0][:q] for x in scores]
            return tokens[:n], logprobs[:n], ScoredTokens(*read)

    def _step_sample_masked(self, chunks: Sequence[SeqChunk], inputs: StepInputs, rows: Sequence[RowSampling],
                            mode: str, sampling: tuple, positions: np.ndarray, score_inputs: tuple | None = None,
                            num_scored: int = 0) -> tuple[np.ndarray, np.ndarray, ScoredTokens | None]:
        """`step_sample` for a step with structured outputs: the forward pass is dispatched first, each constrained
        row's allowed tokens are computed on the host while it runs, then the mask goes to the device and the
        rows are sampled from the masked logits. Unconstrained rows get an all-ones mask (their logits as they are).
        Prompt tokens the step scores (`score_inputs`, as `score_inputs_of` makes them) go through the LM head with
        the sampled rows, as in `_forward_sample_score`."""
        S = inputs.logits_indices.shape[0]
        settings = self._settings
        with self.clock.timing():
            penalties, held = self._penalties(rows, S, mode), min_tokens_arrays(rows, S, mode, self.stop_ids)
            if score_inputs is not None:
                inputs = eqx.tree_at(lambda i: i.logits_indices, inputs,
                                     np.concatenate([inputs.logits_indices, score_inputs[1]]))
            with self.transfers.sending(**_sent(inputs), scoring=score_inputs[1:] if score_inputs else ()):
                self.kv.pool, logits = _logits(self.model, self.kv.pool, inputs, settings)
        mask = np.full((S, mask_words(self.model.config.vocab_size)), -1, np.int32)
        Constraint.fill_masks([r.constraint for r in rows], mask)  # overlaps the forward pass
        n = len(rows)
        with self.clock.timing():
            sent = (*sampling, positions, *host_arrays(penalties, held))
            with self.transfers.sending(sampling=sent, token_mask=mask):
                tokens, logprobs = _masked_pick(settings, logits.array[:S], mode, *sampling, positions, penalties,
                                                mask, held)
                scores = () if score_inputs is None else \
                    _score_logits(settings, logits.array[S:], score_inputs[2], score_inputs[0])
                settle(self.clock, (tokens, logprobs, scores))
            tokens, logprobs = self.transfers.read(tokens=tokens, logprobs=logprobs)
            if score_inputs is None:
                return tokens[:n], logprobs[:n], None
            read = [self.transfers.read(prompt_logprobs=x)[0][:num_scored] for x in scores]
            return tokens[:n], logprobs[:n], ScoredTokens(*read)

    def _penalties(self, rows: Sequence[RowSampling], size: int, mode: str) -> tuple | None:
        """The `penalties` of a call whose mode penalizes (None otherwise): each row's prompt tokens and
        completion counts, built on the device from its token history (padded to a power of two: few programs)."""
        if "+penalties" not in mode:
            return None
        width = bucket(max(len(r.history) for r in rows), MIN_TOKEN_BUCKET)
        history = np.full((size, width), -1, np.int32)
        for r, row in enumerate(rows):
            history[r, :len(row.history)] = row.history
        prompt_lens = np.zeros(size, np.int32)
        prompt_lens[:len(rows)] = [row.num_prompt_tokens for row in rows]
        # Placed as the step's other device inputs (replicated over the mesh), so the state lands there too.
        mesh = self._settings.mesh
        placement = self.kv.pool.array.sharding if mesh is None else NamedSharding(mesh, P())
        with self.transfers.sending(sampling=(history, prompt_lens)):
            history, prompt_lens = (jax.make_array_from_process_local_data(placement, x) for x in (history, prompt_lens))
        in_prompt, counts = _penalty_state(history, prompt_lens, self.model.config.vocab_size)
        pad = size - len(rows)
        return (in_prompt, counts, np.array([r.repetition_penalty for r in rows] + [1.0] * pad, np.float32),
                np.array([r.presence_penalty for r in rows] + [0.0] * pad, np.float32),
                np.array([r.frequency_penalty for r in rows] + [0.0] * pad, np.float32))



def _sent(inputs: StepInputs) -> dict[str, tuple[np.ndarray, ...]]:
    """A step's host arrays by transfer category (engine.transfers): its page table, and the rest."""
    rest = (inputs.token_ids, inputs.positions, inputs.slot_mapping, inputs.cu_q_lens, inputs.kv_lens, inputs.num_seqs,
            inputs.logits_indices, inputs.generated)
    return {"step_inputs": rest, "page_tables": (inputs.page_indices,)}


