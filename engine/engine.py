"""The engine: a checkpoint, a paged KV cache, a scheduler; `generate(requests) -> completions`.

The step is three lines: schedule, run, post-process. Requests may be added while it runs
(`add_request` / `step`), which is how the orchestrator keeps it full across batches.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np

from engine import compile_cache
from engine.attention import prepare_attention_impl
from engine.config import EngineConfig
from engine.distributed import agree
from engine.model_config import ModelConfig
from engine.runner import DecodeRow, ModelRunner, PendingSteps, RowSampling, SeqChunk
from engine.sampler import sample_base_key
from engine.scheduler import ScheduledChunk, Scheduler
from engine.sequence import Request, Sequence
from engine.stats import EngineStats, StepTimer
from engine.stop import StopChecker
from engine.tokenizer_cache import has_tokenizer, load_tokenizer, special_token_texts, text_decoder
from engine.weights import load_transformer


@dataclass(frozen=True)
class Completion:
    """One sample (the record of docs/records.md, without batch_id); `error` is set when the request could not run."""

    prompt_id: str
    generation_index: int
    completion: str
    token_ids: list[int]
    logprobs: list[float] | None
    finish_reason: str | None  # "stop" | "length"; None when error
    num_prompt_tokens: int
    error: str | None = None


NON_FINITE_ERROR = ("non_finite: the model produced NaN or Inf logits; the checkpoint's weights (or the dtype's "
                    "range) are at fault, and rerunning will not help")
"""`Completion.error` of a sample whose logits were not finite; it starts with `non_finite:` (a deterministic fault)."""


class Engine:
    def __init__(self, model_path: str | os.PathLike, config: EngineConfig = EngineConfig(),
                 dtype: str = "float32", mesh=None, tokenizer=None) -> None:
        self.config = config
        compile_cache.enable()  # before the first compile: later processes load the step programs instead
        self.model_config = ModelConfig.from_pretrained(model_path)
        self.max_seq_len = config.max_seq_len or self.model_config.max_position_embeddings
        if config.max_pages * config.page_size < self.max_seq_len:
            raise ValueError(
                f"engine.max_pages={config.max_pages} pages of {config.page_size} tokens hold "
                f"{config.max_pages * config.page_size} tokens, less than one sequence of engine.max_seq_len="
                f"{self.max_seq_len}; raise engine.max_pages to at least "
                f"{math.ceil(self.max_seq_len / config.page_size)} or lower engine.max_seq_len")
        jdtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}.get(dtype)
        if jdtype is None:
            raise ValueError(f"dtype must be float32 or bfloat16, got {dtype!r}")
        prepare_attention_impl(config.attention_impl, jdtype)  # the CPU kernel compiles while the tokenizer loads
        if tokenizer is None and has_tokenizer(model_path):
            tokenizer = load_tokenizer(model_path)
        self.tokenizer = tokenizer
        # Completions leave special tokens out (`<|end|>` is markup, not text); a request whose stop string
        # names a special token decodes them, so that its stop string can fire.
        self._decode = (lambda ids: "") if tokenizer is None else text_decoder(tokenizer, skip_special_tokens=True)
        self._decode_special = (lambda ids: "") if tokenizer is None else text_decoder(tokenizer)
        self._special_texts = frozenset() if tokenizer is None else special_token_texts(tokenizer)
        self.eos_token_ids = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self._stop_ids = sorted(self.eos_token_ids)  # what a multi-step call checks on the device
        # A mesh over several processes (a multi-host slice): every host runs this same program. Check that
        # the hosts agree before the first compiled call (KV pool), and on the requests before the next step.
        # Without such a mesh each process runs its own engine on its own devices and nothing is compared.
        self._multihost = mesh is not None and len({d.process_index for d in mesh.devices.flat}) > 1
        self._requests_digest = hashlib.blake2b(digest_size=16)  # every request added so far, in order
        self._requests_agreed = True
        if self._multihost:
            agree({"engine_config": repr(config), "model_config": repr(self.model_config), "dtype": dtype,
                   "eos_token_ids": repr(sorted(self.eos_token_ids)),
                   "mesh": repr((dict(mesh.shape), mesh.device_ids.tolist()))})
        model = load_transformer(model_path, dtype=jdtype, mesh=mesh, config=self.model_config)
        self.runner = ModelRunner(model, config, self.max_seq_len, mesh=mesh, kv_dtype=jdtype)
        self.scheduler = Scheduler(config, self.runner.kv.allocator)
        self._retained: list[Sequence] = []  # finished, pages kept (cleanup_mode end / none)
        self._arrivals = 0
        self._last_queued: Sequence | None = None  # the newest queued sequence, to group samples of one prompt
        self.stats = EngineStats()
        self.num_multi_step_fallbacks = 0  # decode-only steps run singly because their pages were not free
        # A multi-step call continuing the previous one's rows, dispatched before the host read that one
        # (engine.pipeline_decode): (its rows' sequences, the call). step() reads it next.
        self._ahead: tuple[list[Sequence], PendingSteps] | None = None
        self.num_pipelined_calls = 0  # multi-step calls dispatched ahead that way

    # -- requests -------------------------------------------------------------------------------

    def validate(self, request: Request) -> str | None:
        """Why the request cannot run, or None; the message starts with the reason a run writes to
        rejected.jsonl (`too_long: ...`) where there is one."""
        n, m = len(request.prompt_token_ids), request.sampling.max_new_tokens
        if n == 0:
            return "empty_prompt: the prompt has no tokens"
        if n + m > self.max_seq_len:
            return (f"too_long: prompt has {n} tokens; with sampling.max_new_tokens={m} it needs {n + m}, more than "
                    f"the engine's max context of {self.max_seq_len} tokens (engine.max_seq_len)")
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in request.prompt_token_ids):
            return f"wrong_type: prompt token ids must lie in [0, {vocab}) (the model's vocab_size)"
        if request.sampling.stop and self.tokenizer is None:
            return "sampling.stop needs a tokenizer to decode text, and the model directory has none"
        return None

    def add_request(self, request: Request) -> Completion | None:
        """Queue a request; a request that cannot run comes straight back as a Completion with `error`."""
        if self._multihost:
            self._requests_digest.update(repr(request).encode("utf-8") + b"\0")
            self._requests_agreed = False
        error = self.validate(request)
        if error is not None:
            return Completion(request.prompt_id, request.generation_index, "", [], None, None,
                              len(request.prompt_token_ids), error)
        s = request.sampling
        names_special = any(t in stop for stop in s.stop for t in self._special_texts)
        stop = StopChecker(stop_strings=s.stop, eos_token_ids=self.eos_token_ids, max_new_tokens=s.max_new_tokens,
                           decode=self._decode_special if names_special else self._decode)
        seq = Sequence(request, self._arrivals, sample_base_key(s.seed, request.prompt_id, request.generation_index),
                       stop, token_ids=list(request.prompt_token_ids))
        self._arrivals += 1
        head = self._last_queued
        # The newest queued sequence is still waiting (never admitted, nothing generated): O(1) to check,
        # so queueing a large batch stays linear.
        if (head is not None and head.num_computed == 0 and not head.pages
                and len(head.token_ids) == head.num_prompt_tokens and head not in self.scheduler.running
                and head.request.prompt_id == request.prompt_id
                and head.request.prompt_token_ids == request.prompt_token_ids
                and 1 + len(head.siblings) + 1 <= self.config.max_seqs):
            head.siblings.append(seq)  # another sample of the same prompt: forks from `head` after its prefill
        else:
            self.scheduler.add(seq)
            self._last_queued = seq
        return None

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work

    @property
    def num_pages_in_use(self) -> int:
        """KV pages held now (O(1); `snapshot` also scans every page's refcount)."""
        return self.runner.kv.allocator.num_used

    @property
    def num_waiting(self) -> int:
        """Queued sequences not yet admitted (a caller feeding the engine adds more when this reaches 0)."""
        return len(self.scheduler.waiting)

    def step(self) -> list[Completion]:
        """One device step; returns the samples that finished in it."""
        if not self._requests_agreed:  # requests were added since the hosts last compared them
            agree({"requests": self._requests_digest.hexdigest()})
            self._requests_agreed = True
        if self._ahead is not None:
            return self._step_ahead()
        chunks = self.scheduler.schedule()
        if not chunks:
            raise RuntimeError(self._stuck_message())
        limits = self._multi_step_limits(chunks)
        if limits is not None:
            return self._multi_step(chunks, limits)
        # Output rows: one per chunk, plus one per sibling of a sequence whose prompt completes now
        # (the siblings sample their first token from the same logits, each with its own key).
        row_seqs, row_chunk, forks = [], [], []
        for i, c in enumerate(chunks):
            row_seqs.append(c.seq)
            row_chunk.append(i)
            if c.completes and c.seq.siblings and len(c.seq.token_ids) == c.seq.num_prompt_tokens:
                forks.append(c.seq)
                row_seqs += c.seq.siblings
                row_chunk += [i] * len(c.seq.siblings)
        with StepTimer(self.stats, chunks, self.runner.clock):
            rows = [_row_sampling(q) for q in row_seqs]
            tokens, logprobs = self.runner.step_sample(
                [SeqChunk(c.seq.token_ids[c.seq.num_computed:c.seq.num_computed + c.num_tokens], c.seq.num_computed,
                          c.seq.pages) for c in chunks], rows, row_chunk)
        completes = [c.completes for c in chunks]  # before num_computed moves on
        for c in chunks:
            c.seq.num_computed += c.num_tokens
        for parent in forks:
            self._fork(parent)
        done = []
        for seq, i, token, logprob in zip(row_seqs, row_chunk, tokens.tolist(), logprobs.tolist()):
            if not completes[i]:  # a prompt chunk short of the prompt's end: no token yet (siblings ride on
                continue          # their parent's chunk, which completes by construction)
            if seq.num_computed != len(seq.token_ids):  # a sibling that could not fork: it will run alone
                continue
            seq.token_ids.append(token)
            seq.logprobs.append(logprob)
            if seq.stop.push(token) is not None:
                done.append(self._finish(seq))
        if self.config.debug_invariants:
            self.check_invariants()
        return done

    def _multi_step_limits(self, chunks: list[ScheduledChunk]) -> list[int] | None:
        """Decode steps each sequence may take in one device call, its pages for them allocated; None when
        this step must be a single one (not decode-only, a waiting sequence could be admitted now, or the
        pages are not free: the single step's scheduling preempts where it must)."""
        K = self.config.decode_steps
        if K == 1 or self.scheduler.head_has_slots:
            return None
        if not all(c.num_tokens == 1 and c.completes and not c.seq.siblings for c in chunks):
            return None
        ps = self.config.page_size
        limits, needs = [], []
        for c in chunks:
            seq = c.seq
            limit = min(K, self._remaining(seq))
            limits.append(limit)
            needs.append(max(0, math.ceil((seq.num_computed + limit) / ps) - len(seq.pages)))
        alloc = self.runner.kv.allocator
        if sum(needs) > alloc.num_free:
            self.num_multi_step_fallbacks += 1
            return None
        for c, need in zip(chunks, needs):
            c.seq.pages.extend(alloc.allocate(need))
        return limits

    def _remaining(self, seq: Sequence) -> int:
        """Tokens a decoding sequence may still generate. Step i of a multi-step call writes the KV of
        position num_computed + i (below max_seq_len, like a single step's chunk) and generates the token at
        num_computed + i + 1; a row never generates past max_new_tokens."""
        generated = len(seq.token_ids) - seq.num_prompt_tokens
        return min(seq.request.sampling.max_new_tokens - generated, self.max_seq_len - len(seq.token_ids) + 1)

    def _multi_step(self, chunks: list[ScheduledChunk], limits: list[int]) -> list[Completion]:
        """Several decode steps in one device call (EOS and limits checked on the device); the host then
        feeds each row's tokens to its StopChecker, which may stop it earlier (a stop string). With
        engine.pipeline_decode the call continuing these rows is dispatched before this one is read."""
        seqs = [c.seq for c in chunks]
        with StepTimer(self.stats, chunks, self.runner.clock) as timer:
            rows = [DecodeRow(q.token_ids[-1], q.num_computed, q.pages, limit, _row_sampling(q))
                    for q, limit in zip(seqs, limits)]
            pending = self.runner.dispatch_multi_step(rows, self._stop_ids, self.config.decode_steps,
                                                      [self._remaining(q) for q in seqs])
            self._ahead = self._chain(seqs, pending)
            tokens, logprobs, steps = self.runner.fetch_multi_step(pending)
            timer.decode_tokens = int(steps.sum())
            timer.model_steps = int(steps.max())
        return self._take_steps(seqs, tokens, logprobs, steps)

    def _chain(self, seqs: list[Sequence], prev: PendingSteps) -> tuple[list[Sequence], PendingSteps] | None:
        """Dispatch the call continuing `prev`'s rows (not yet read) when pipelining applies: no sequence
        waits (a row that stops in `prev` idles through the new call, and a waiting sequence would wait for
        its slot that much longer: measured, a job with early stops lost 3 points of occupancy), some row is
        still running, and every running row's pages can cover both calls. Rows the host has finished take
        no steps in it."""
        if not self.config.pipeline_decode or self.scheduler.waiting:
            return None
        alive = [not q.stop.finished for q in seqs]
        if not any(alive):
            return None
        K, ps = self.config.decode_steps, self.config.page_size
        # A row that reaches its last token in `prev` is known to end there: when every row does, there is
        # nothing to continue (the call would find every row done).
        if not any(a and self._remaining(q) > K for q, a in zip(seqs, alive)):
            return None
        # The host has read every call before `prev`: each row's KV covers num_computed tokens, and `prev`
        # and this call together write at most min(2K, remaining) more.
        needs = [max(0, math.ceil((q.num_computed + min(2 * K, self._remaining(q))) / ps) - len(q.pages)) if a else 0
                 for q, a in zip(seqs, alive)]
        alloc = self.runner.kv.allocator
        if sum(needs) > alloc.num_free:
            return None
        for q, need in zip(seqs, needs):
            if need:
                q.pages.extend(alloc.allocate(need))
        pages = [q.pages if a else [] for q, a in zip(seqs, alive)]
        self.num_pipelined_calls += 1
        return seqs, self.runner.chain_multi_step(prev, pages, alive, K)

    def _step_ahead(self) -> list[Completion]:
        """Read the call dispatched ahead, after dispatching the one that continues it (when it applies)."""
        seqs, pending = self._ahead
        live = [q for q in seqs if not q.stop.finished]
        with StepTimer(self.stats, [ScheduledChunk(q, 1) for q in live], self.runner.clock) as timer:
            self._ahead = self._chain(seqs, pending)
            tokens, logprobs, steps = self.runner.fetch_multi_step(pending)
            timer.decode_tokens = int(steps[np.array([not q.stop.finished for q in seqs])].sum())
            timer.model_steps = int(steps.max())
        return self._take_steps(seqs, tokens, logprobs, steps)

    def _take_steps(self, seqs: list[Sequence], tokens: np.ndarray, logprobs: np.ndarray, steps: np.ndarray
                    ) -> list[Completion]:
        """Feed each row's tokens of one multi-step call to its sequence; a row the host finished before
        (a stop string in the previous call, the device running ahead) is skipped."""
        tokens, logprobs, steps = tokens.T.tolist(), logprobs.T.tolist(), steps.tolist()
        done = []
        for seq, row_tokens, row_logprobs, num_steps in zip(seqs, tokens, logprobs, steps):
            if seq.stop.finished:
                continue
            for token, logprob in zip(row_tokens[:num_steps], row_logprobs[:num_steps]):
                seq.num_computed += 1  # the KV of the token this one was generated from is cached
                seq.token_ids.append(token)
                seq.logprobs.append(logprob)
                if seq.stop.push(token) is not None:  # later tokens of this row are dropped
                    done.append(self._finish(seq))
                    break
        if self._ahead is not None and all(q.stop.finished for q in self._ahead[0]):
            self._ahead = None  # every row it continues has finished: nothing in it is wanted
        if self.config.debug_invariants:
            self.check_invariants()
        return done

    def _finish(self, seq: Sequence) -> Completion:
        """Take a finished sequence out of the running set; its pages go back now (incremental) or later."""
        incremental = self.config.cleanup_mode == "incremental"
        self.scheduler.finish(seq, free_pages=incremental)
        if not incremental:
            self._retained.append(seq)
        return self._completion(seq)

    def _fork(self, parent: Sequence) -> None:
        """Siblings share the parent's full prompt pages and get a copy of its partial last page."""
        alloc, ps = self.runner.kv.allocator, self.config.page_size
        num_full = parent.num_prompt_tokens // ps
        partial = parent.num_prompt_tokens % ps != 0
        src, dst = [], []
        for sib in parent.siblings:
            own = alloc.allocate(1) if partial else []
            if own is None:  # no page for the copy now: the sibling computes its prompt alone later
                self.scheduler.add(sib)
                continue
            alloc.share(parent.pages[:num_full])
            sib.pages = parent.pages[:num_full] + own
            if partial:
                src.append(parent.pages[num_full])
                dst.append(own[0])
            sib.num_computed = parent.num_computed
            self.scheduler.admit_fork(sib)
        parent.siblings = []
        self.runner.kv.copy_pages(src, dst)

    def generate(self, requests: Iterable[Request], reset: bool = True,
                 on_finish: Callable[[Completion], None] | None = None) -> list[Completion]:
        """Run every request to completion; results in request order. Ends with a reset unless told not to.
        `stats` then describe this call alone (its performance summary: `stats.summary(max_seqs)`)."""
        requests = list(requests)
        keys = [(r.prompt_id, r.generation_index) for r in requests]
        if len(set(keys)) != len(keys):
            dup = next(k for i, k in enumerate(keys) if k in keys[:i])
            raise ValueError(f"(prompt_id, generation_index)={dup} appears more than once; each sample needs its own key")
        results: dict[tuple[str, int], Completion] = {}
        self.stats.clear()
        for r in requests:
            early = self.add_request(r)
            if early is not None:
                results[(r.prompt_id, r.generation_index)] = early
                if on_finish:
                    on_finish(early)
        while self.has_unfinished:
            for done in self.step():
                results[(done.prompt_id, done.generation_index)] = done
                if on_finish:
                    on_finish(done)
        if self.config.cleanup_mode == "end":
            self.release_finished()
        if reset:
            self.reset()
        return [results[(r.prompt_id, r.generation_index)] for r in requests]

    # -- pages, reset, invariants ----------------------------------------------------------------

    def release_finished(self) -> None:
        """Free the pages that finished sequences still hold (cleanup_mode `end` or `none`)."""
        for seq in self._retained:
            self.runner.kv.allocator.free(seq.pages)
            seq.pages = []
        self._retained = []

    def reset(self, mode: str | None = None) -> None:
        """Drop every sequence and allocation; `physical` also zeroes the KV pool. Same on every host."""
        if self.scheduler.has_work:
            raise RuntimeError("reset while sequences are still running; finish or drop them first")
        self._retained = []
        self._ahead = None
        self.runner.kv.reset(mode or self.config.reset_mode)

    def abort(self) -> None:
        """Drop every queued and running sequence, free all pages and reset (after a failed step)."""
        self.scheduler.waiting.clear()
        self.scheduler.running.clear()
        self._ahead = None
        self._last_queued = None
        self._retained = []
        # Every host aborts together, so the request record starts afresh everywhere (a batch the hosts
        # disagreed on must not poison the comparison of the batches after it).
        self._requests_digest = hashlib.blake2b(digest_size=16)
        self._requests_agreed = True
        # A step that failed after donating the pool leaves it deleted: rebuild it then.
        self.runner.kv.reset("physical" if self.runner.kv.pool.array.is_deleted() else self.config.reset_mode)

    def check_invariants(self) -> None:
        live = self.scheduler.running + self._retained
        self.runner.kv.allocator.check([s.pages for s in live])
        assert self.scheduler.slots_in_use <= self.config.max_seqs, "more live sequences than engine.max_seqs"
        for s in self.scheduler.running:
            assert 0 <= s.num_computed <= len(s.token_ids) <= self.max_seq_len, f"sequence {s.request.prompt_id}"
            assert len(s.pages) * self.config.page_size >= s.num_computed
            assert all(self.runner.kv.allocator.refcount(p) >= 1 for p in s.pages)

    def snapshot(self) -> dict[str, int]:
        """Stats every host can read (host-side state only, no device read)."""
        alloc = self.runner.kv.allocator
        return {"active_seqs": len(self.scheduler.running), "waiting_seqs": len(self.scheduler.waiting),
                "pages_in_use": alloc.num_used, "free_pages": alloc.num_free, "max_refcount": alloc.max_refcount,
                "num_preemptions": self.scheduler.num_preemptions,
                "num_multi_step_fallbacks": self.num_multi_step_fallbacks,
                "num_pipelined_calls": self.num_pipelined_calls}

    # -- helpers ---------------------------------------------------------------------------------

    def _completion(self, seq: Sequence) -> Completion:
        d = seq.stop.decision
        n = d.num_tokens
        keep_logprobs = seq.request.sampling.logprobs
        # A chosen token's raw logprob is non-finite only when its step's logits held NaN or +Inf: the tokens are
        # garbage (argmax of NaN is 0), so the sample is an error, never a result (a deterministic fault).
        if not all(math.isfinite(x) for x in seq.logprobs[:n]):
            return Completion(seq.request.prompt_id, seq.request.generation_index, "", [], None, None,
                              seq.num_prompt_tokens, NON_FINITE_ERROR)
        return Completion(seq.request.prompt_id, seq.request.generation_index, d.completion,
                          seq.token_ids[seq.num_prompt_tokens:seq.num_prompt_tokens + n],
                          seq.logprobs[:n] if keep_logprobs else None, d.finish_reason, seq.num_prompt_tokens)

    def _stuck_message(self) -> str:
        alloc = self.runner.kv.allocator
        head = self.scheduler.waiting[0] if self.scheduler.waiting else None
        need = 0 if head is None else math.ceil(len(head.token_ids) / self.config.page_size)
        return (f"no sequence can run: {len(self.scheduler.waiting)} waiting, the first needs {need} pages, "
                f"{alloc.num_free} of {alloc.num_pages} are free and {len(self._retained)} finished sequences "
                f"still hold pages (engine.cleanup_mode={self.config.cleanup_mode}); raise engine.max_pages or use "
                f"cleanup_mode=incremental")


def _row_sampling(seq: Sequence) -> RowSampling:
    """How the sequence's next token (at index len(token_ids)) is drawn."""
    s = seq.request.sampling
    return RowSampling(s.temperature, s.top_k, s.top_p, seq.base_key, len(seq.token_ids))

