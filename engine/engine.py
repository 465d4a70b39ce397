"""The engine: a checkpoint, a scheduler that owns the pages and sequences, and a runner that owns the
device; `generate(requests) -> samples`.

A step is three lines: the scheduler decides (`SchedulerOutput`, plain data, with its `StepCounts` beside it),
the runner runs it on the device (`RunnerOutput`), and the scheduler's `postprocess` appends the tokens, checks
stop strings (the one end condition the device cannot decide) and finishes sequences. Requests may be added
while it runs (`add_request` / `step`), which is how the orchestrator keeps it full across batches.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Callable, Iterable

import jax.numpy as jnp

from engine.device import compile_cache
from engine.kernels.attention import prepare_attention_impl
from engine.sizing.capacity import check_pool, max_seq_len, scored_sampling_error, validate_request
from engine.config import DTYPES, EngineConfig
from engine.distributed import agree
from engine.kv.kv_groups import KVGroups
from engine.models.model_config import ModelConfig
from engine.record import SampleRecord
from engine.device.runner import ModelRunner
from engine.device.runner_config import RunnerConfig
from engine.sampling.sampler import sample_base_key
from engine.sampling.structured import Compiler, compiler_for
from engine.scheduling.scheduler import Scheduler, SchedulerConfig
from engine.scheduling.scheduler_output import RunnerOutput, SchedulerOutput, StepCounts
from engine.scheduling.sequence import Request, Sequence
from engine.stats import EngineStats, StepTimer
from engine.scheduling.stop import StopChecker
from engine.tokenizer.tokenizer_cache import has_tokenizer, load_tokenizer, special_token_texts, text_decoder
from engine.models.weights import load_transformer

NON_FINITE_ERROR = ("non_finite: the model produced NaN or Inf logits; the checkpoint's weights (or the dtype's "
                    "range) are at fault, and rerunning will not help")
"""`SampleRecord.error` of a sample whose logits were not finite; it starts with `non_finite:` (a deterministic
fault)."""


class Engine:
    def __init__(self, model_path: str | os.PathLike, config: EngineConfig = EngineConfig(),
                 dtype: str = "float32", mesh=None, tokenizer=None) -> None:
        self.config = config
        compile_cache.count_programs()  # the stats' programs compiled and loaded
        self.programs_at_start = compile_cache.programs()
        compile_cache.enable()  # before the first compile: later processes load the step programs instead
        self.model_config = ModelConfig.from_pretrained(model_path)
        self.max_seq_len = max_seq_len(config, self.model_config.max_position_embeddings, str(model_path))
        check_pool(config, self.max_seq_len)
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        jdtype = getattr(jnp, dtype)  # jnp.float32, jnp.bfloat16
        prepare_attention_impl(config.attention_impl, jdtype)  # the CPU kernel compiles while the tokenizer loads
        if tokenizer is None and has_tokenizer(model_path):
            tokenizer = load_tokenizer(model_path)
        eos_token_ids = set(self.model_config.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos_token_ids.add(tokenizer.eos_token_id)
        # A mesh over several processes (a multi-host slice): every host runs this same program. Check that
        # the hosts agree before the first compiled call (KV pool), and on the requests before the next step.
        # Without such a mesh each process runs its own engine on its own devices and nothing is compared.
        self._multihost = mesh is not None and len({d.process_index for d in mesh.devices.flat}) > 1
        self._requests_digest = hashlib.blake2b(digest_size=16)  # every request added so far, in order
        self._requests_agreed = True
        if self._multihost:
            agree({"engine_config": repr(config), "model_config": repr(self.model_config), "dtype": dtype,
                   "eos_token_ids": repr(sorted(eos_token_ids)),
                   "mesh": repr((dict(mesh.shape), mesh.device_ids.tolist()))})
        self.load_report: dict = {}
        """`load_s` and `bytes_read` (from an object store: only this host's shards; 0 for a local checkpoint)."""
        model = load_transformer(model_path, dtype=jdtype, mesh=mesh, config=self.model_config, report=self.load_report)
        cfg = self.model_config
        groups = KVGroups.for_engine(cfg.layer_windows(), config.kv_groups, config.host_kv_pages)
        runner = ModelRunner(model, RunnerConfig.of(config, groups), self.max_seq_len, eos_token_ids, mesh=mesh,
                             kv_dtype=jdtype)
        self._setup(config, runner, cfg.vocab_size, eos_token_ids, tokenizer, cfg.image_token_id, groups)
        self.stats.programs_before = self.programs_at_start  # the build's programs (the KV pool, the layers) count

    @classmethod
    def from_runner(cls, runner, config: EngineConfig, vocab_size: int, eos_token_ids: Iterable[int],
                    tokenizer=None, groups: KVGroups | None = None) -> "Engine":
        """An engine over a given runner: anything with `run(SchedulerOutput) -> RunnerOutput`, `reset`,
        `clock`, `transfers` (a TransferLedger) and `max_seq_len` (a dummy model drives the loop in tests).
        Single-host."""
        engine = cls.__new__(cls)
        engine._multihost, engine._requests_digest, engine._requests_agreed = False, None, True
        engine.programs_at_start = compile_cache.programs()
        engine._setup(config, runner, vocab_size, set(eos_token_ids), tokenizer, groups=groups)
        return engine

    def _setup(self, config: EngineConfig, runner, vocab_size: int, eos_token_ids: set[int], tokenizer,
               image_token_id: int | None = None, groups: KVGroups | None = None) -> None:
        """`groups`: the KV pool's layer groups, the runner's too (None: one page table for every layer)."""
        self.config = config
        self.image_token_id = image_token_id  # a multimodal checkpoint's image placeholder: refused in prompts
        self.runner = runner
        self.max_seq_len = runner.max_seq_len
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.tokenizer = tokenizer
        self._grammars: Compiler | None = None
        # Completions leave special tokens out (`<|end|>` is markup, not text); a request whose stop string
        # names a special token decodes them, so that its stop string can fire.
        self._decode = (lambda ids: "") if tokenizer is None else text_decoder(tokenizer, skip_special_tokens=True)
        self._decode_special = (lambda ids: "") if tokenizer is None else text_decoder(tokenizer)
        self._special_texts = frozenset() if tokenizer is None else special_token_texts(tokenizer)
        self.scheduler = Scheduler(SchedulerConfig.of(config, groups), self.max_seq_len)
        self._arrivals = 0
        self.stats = EngineStats()

    # -- requests -------------------------------------------------------------------------------

    def validate(self, request: Request) -> str | None:
        """Why the request cannot run, or None; the message starts with the reason a run writes to
        rejected.jsonl (`too_long: ...`) where there is one."""
        error = validate_request(request.prompt_token_ids, request.sampling, self.max_seq_len, self.vocab_size,
                                 self.tokenizer is not None, request.num_context_tokens, self.image_token_id)
        spec = request.sampling.structured
        if error is not None or spec is None:
            return error
        if request.is_scored:
            return scored_sampling_error(request.sampling)
        if self.tokenizer is None:
            return f"invalid_grammar: sampling.{spec[0]} needs the model's tokenizer, and this engine has none"
        why = self.grammars.error(spec)
        return None if why is None else f"invalid_grammar: sampling.{spec[0]}: {why}"

    @property
    def grammars(self) -> Compiler:
        """The structured outputs' grammars for this engine's tokenizer, each compiled once per process."""
        if self._grammars is None:  # serialising the tokenizer to find the process's compiler costs milliseconds
            self._grammars = compiler_for(self.tokenizer, self.vocab_size)
        return self._grammars

    def add_request(self, request: Request) -> SampleRecord | None:
        """Queue a request; a request that cannot run comes straight back as a record with `error`."""
        if self._multihost:
            self._requests_digest.update(repr(request).encode("utf-8") + b"\0")
            self._requests_agreed = False
        error = self.validate(request)
        if error is not None:
            return SampleRecord(request.prompt_id, request.generation_index, "", [], None, None,
                                len(request.prompt_token_ids), error=error)
        s = request.sampling
        names_special = any(t in stop for stop in s.stop for t in self._special_texts)
        stop_ids = (set() if s.ignore_eos else self.eos_token_ids) | set(s.stop_token_ids)
        if request.is_scored:  # one token is drawn after the continuation and dropped: the engine's usual end
            stop = StopChecker(max_new_tokens=1, decode=lambda ids: "", start=len(request.prompt_token_ids))
        else:
            stop = StopChecker(stop_strings=s.stop, eos_token_ids=stop_ids,
                               max_new_tokens=s.max_new_tokens, min_tokens=s.min_tokens,
                               decode=self._decode_special if names_special else self._decode,
                               start=len(request.prompt_token_ids))
        spec = s.structured
        self.scheduler.add(Sequence(request, self._arrivals, sample_base_key(s.seed, request.prompt_id,
                                                                             request.generation_index),
                                    stop, token_ids=list(request.prompt_token_ids),
                                    constraint=None if spec is None else self.grammars.constraint(spec, stop_ids)))
        self._arrivals += 1
        return None

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work

    @property
    def num_pages_in_use(self) -> int:
        """KV pages (of every layer) held now (O(1); `snapshot` also scans every page's refcount)."""
        return self.scheduler.kv.pages_in_use

    @property
    def num_waiting(self) -> int:
        """Queued sequences not yet admitted (a caller feeding the engine adds more when this reaches 0)."""
        return len(self.scheduler.waiting)

    # -- the step -------------------------------------------------------------------------------

    def step(self) -> list[SampleRecord]:
        """One device call: schedule, run, post-process; returns the samples that finished in it."""
        self._agree_on_requests()
        out, counts = self.scheduler.schedule()
        result = self._run(out, counts)
        return [self._record(seq) for seq in self.scheduler.postprocess(out, result)]

    def _run(self, out: SchedulerOutput, counts: StepCounts) -> RunnerOutput:
        """Run a scheduled step on the device, timed, and record it in the stats."""
        if out.is_empty:
            raise RuntimeError(self.scheduler.stuck_message())
        self.stats.add_scheduled(counts)
        with StepTimer(self.stats, self.runner.clock, self.runner.transfers) as timer:
            result = self.runner.run(out)
            _count(timer, out, result)
        return result

    def _record(self, seq: Sequence) -> SampleRecord:
        """The record of a finished sequence."""
        d = seq.stop.decision
        start, n = seq.num_prompt_tokens, d.num_tokens
        # A chosen token's raw logprob is non-finite only when its step's logits held NaN or +Inf: the tokens are
        # garbage (argmax of NaN is 0), so the sample is an error, never a result (a deterministic fault).
        request = seq.request
        scores = [seq.scores[p] for p in range(request.first_scored or start, start)]
        if not all(math.isfinite(x) for x in seq.logprobs[:n] + [s.logprob for s in scores]):
            return SampleRecord(request.prompt_id, request.generation_index, "", [], None, None,
                                seq.num_prompt_tokens, error=NON_FINITE_ERROR)
        prompt_logprobs = None if request.sampling.prompt_logprobs is None else [
            {"token_id": t, "logprob": s.logprob, "top": [{"token_id": i, "logprob": lp} for i, lp in s.top]}
            for t, s in zip(seq.token_ids[1:start], scores)]
        if request.is_scored:
            context = request.num_context_tokens
            continuation = [seq.scores[p] for p in range(context, start)]
            logprobs = [s.logprob for s in continuation]
            return SampleRecord(request.prompt_id, request.generation_index, "", seq.token_ids[context:start], None,
                                None, context, continuation_logprobs=logprobs, continuation_logprob=math.fsum(logprobs),
                                is_greedy=all(s.is_argmax for s in continuation), prompt_logprobs=prompt_logprobs)
        return SampleRecord(request.prompt_id, request.generation_index, d.completion,
                            seq.token_ids[start:start + n], seq.logprobs[:n] if request.sampling.logprobs else None,
                            d.finish_reason, seq.num_prompt_tokens, prompt_logprobs=prompt_logprobs)

    def _agree_on_requests(self) -> None:
        if not self._requests_agreed:  # requests were added since the hosts last compared them
            agree({"requests": self._requests_digest.hexdigest()})
            self._requests_agreed = True

    # -- whole calls, reset ---------------------------------------------------------------------

    def generate(self, requests: Iterable[Request], reset: bool = False,
                 on_finish: Callable[[SampleRecord], None] | None = None) -> list[SampleRecord]:
        """Run every request to completion; results in request order. Ends with every page released but the
        prefix cache kept for the next call (`settle`), or with a reset when told (`reset=True`). `stats` then
        describe this call alone (its performance summary: `stats.summary(max_seqs)`)."""
        requests = list(requests)
        keys = [(r.prompt_id, r.generation_index) for r in requests]
        if len(set(keys)) != len(keys):
            dup = next(k for i, k in enumerate(keys) if k in keys[:i])
            raise ValueError(f"(prompt_id, generation_index)={dup} appears more than once; each sample needs its own key")
        results: dict[tuple[str, int], SampleRecord] = {}
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
        if reset:
            self.reset()
        else:
            self.settle()
        return [results[(r.prompt_id, r.generation_index)] for r in requests]

    def programs(self) -> dict[str, float]:
        """The XLA programs compiled and loaded from the compile cache since this engine began its build (its KV
        pool, its layers, every step program since: compile_cache.programs), by whichever caller in the process."""
        return compile_cache.programs_since(self.programs_at_start)

    def release_finished(self) -> None:
        """Free the pages that finished sequences still hold (cleanup_mode `end` or `none`)."""
        self.scheduler.release_finished()

    def settle(self) -> None:
        """Between calls, with nothing unfinished: free the pages finished sequences hold and forget a call
        dispatched ahead; the prefix cache stays for later requests. Under reset_mode `physical` (the pool is
        zeroed between calls) this is a reset. Executed the same way on every host."""
        if self.config.reset_mode == "physical":
            self.reset()
            return
        if self.scheduler.has_work:
            raise RuntimeError("settle while sequences are still running; finish or drop them first")
        self.scheduler.reset(keep_cache=True)
        self.runner.reset(physical=False)

    def reset(self, mode: str | None = None) -> None:
        """Drop every allocation and the prefix cache; `physical` also zeroes the KV pool. Executed the same way
        on every host."""
        mode = mode or self.config.reset_mode
        if mode not in ("logical", "physical"):
            raise ValueError(f"reset mode must be 'logical' or 'physical', got {mode!r}")
        if self.scheduler.has_work:
            raise RuntimeError("reset while sequences are still running; finish or drop them first")
        self._reset(mode)

    def abort(self) -> None:
        """Drop every queued and running sequence, free all pages and reset (after a failed step)."""
        # Every host aborts together, so the request record starts afresh everywhere (a batch the hosts
        # disagreed on must not poison the comparison of the batches after it).
        self._requests_digest = hashlib.blake2b(digest_size=16)
        self._requests_agreed = True
        self._reset(self.config.reset_mode)

    def _reset(self, mode: str) -> None:
        self.scheduler.reset()
        self.runner.reset(physical=mode == "physical")

    def check_invariants(self) -> None:
        self.scheduler.check_invariants()

    def snapshot(self) -> dict[str, int]:
        """Stats every host can read (host-side state only, no device read)."""
        sched, kv = self.scheduler, self.scheduler.kv.snapshot()
        figures = {"active_seqs": len(sched.running), "waiting_seqs": len(sched.waiting),
                   "num_preemptions": sched.num_preemptions, "num_multi_step_fallbacks": sched.num_multi_step_fallbacks,
                   "num_pipelined_calls": sched.num_pipelined_calls, **kv}
        order = ("active_seqs", "waiting_seqs", "pages_in_use", "free_pages", "max_refcount", "num_preemptions",
                 "num_multi_step_fallbacks", "num_pipelined_calls", "cached_pages", "host_kv_pages_in_use",
                 "num_swaps", "num_swap_fallbacks", "host_cached_pages")
        return {k: figures[k] for k in order}


def _count(timer: StepTimer, out: SchedulerOutput, result: RunnerOutput) -> None:
    """The step's counts for EngineStats: sequences that ran, prompt (or recomputed) tokens, tokens drawn
    (every row of a multi-step call the host had not finished, all its steps), forward passes."""
    if out.decode is None:
        timer.active_seqs = len(out.chunks)
        timer.prefill_tokens = sum(c.num_tokens for c in out.chunks if c.num_tokens > 1 or not c.completes)
        timer.decode_tokens = sum(1 for i in out.row_chunk if out.chunks[i].completes)
        return
    live = out.decode.live
    timer.active_seqs = sum(live)
    timer.decode_tokens = int(sum(s for s, a in zip(result.steps.tolist(), live) if a))
    timer.model_steps = int(result.steps.max())
