"""engine/scheduling/scheduler.py alone (no JAX, no model): the engine loop over a dummy runner.

The dummy runner keeps a fake KV pool (slot -> token id) and "predicts" the next token from the token ids it
reads back through the sequence's page table, so a wrong page table, a lost copy or a page shared by mistake
changes the samples. Every sample is compared with the same dummy model run on the request alone.
"""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import EngineConfig, Request, SamplingConfig, pages_needed
from engine.engine import Engine
from engine.device.multi_step import stopped_at_a_stop_id
from engine.kv.kv_groups import NONE, KVGroups, held
from engine.scheduling.scheduler_output import RunnerOutput, SchedulerOutput
from engine.stats import DeviceClock
from engine.device.transfers import TransferLedger

VOCAB, EOS = 40, 0


def next_token(context: tuple[int, ...], base_key, sampled: bool) -> int:
    """The dummy model: a hash of the context (and of the sample's key when it samples)."""
    key = (context, tuple(int(k) for k in base_key) if sampled else None)
    return int.from_bytes(hashlib.blake2b(repr(key).encode(), digest_size=4).digest(), "little") % VOCAB


class DummyRunner:
    """The runner's contract (SchedulerOutput in, RunnerOutput out) over a fake KV pool."""

    def __init__(self, config: EngineConfig, max_seq_len: int, groups: KVGroups | None = None) -> None:
        self.config, self.max_seq_len = config, max_seq_len
        self.groups = groups or KVGroups.single(1)
        self.clock = DeviceClock()
        self.transfers = TransferLedger()  # a dummy moves nothing: every call's bytes are 0
        self.kv: dict[int, int] = {}
        self.host: dict[int, int] = {}  # the host pool: host slot -> token id
        self.generated: dict[int, dict[int, int]] = {}  # sequence id -> position -> token written past the prompt
        self.written = 0  # KV entries written by steps (a swapped sequence writes none of its old ones again)
        self._ahead = None
        self.first_scheduled: list = []  # sequences in the order their first prompt chunk ran
        self.seqs: dict = {}  # every sequence queued, by id (the output names sequences by id): `make_engine` fills it
        self._landing: dict[int, int] = {}  # page-ins issued a step ahead: device slot -> token id, at the next run

    def _slot(self, pages, pos: int) -> int:
        ps = self.config.page_size
        assert pages[pos // ps] != NONE, f"position {pos} is in a page given back"
        return pages[pos // ps] * ps + pos % ps

    def _write(self, pages, pos: int, token: int, seq_id: int) -> None:
        """A token's KV goes to its page in every layer group (the units of all groups come from one allocator)."""
        for group in pages:
            self.kv[self._slot(group, pos)] = token
        self.generated.setdefault(seq_id, {})[pos] = token
        self.written += 1

    def _context(self, pages, n: int, seq_id: int, query: int | None = None) -> tuple[int, ...]:
        """The tokens before position n read back through the page table of a group without a window (the dummy
        model reads them all; when every group slides, from the prompt and what this runner wrote for the
        sequence); every sliding group must hold the same in the window of the query at `query` (default n - 1:
        positions query - window + 1 .. query)."""
        if None in self.groups.windows:
            full = self.groups.windows.index(None)
            context = tuple(self.kv[self._slot(pages[full], p)] for p in range(n))
        else:
            prompt, written = self.seqs[seq_id].request.prompt_token_ids, self.generated.get(seq_id, {})
            context = tuple(prompt[p] if p < len(prompt) else written[p] for p in range(n))
        query = n - 1 if query is None else query
        for g, window in enumerate(self.groups.windows):
            for p in range(0 if window is None else max(0, query - window + 1), n):
                assert self.kv[self._slot(pages[g], p)] == context[p], f"group {g} lost position {p}"
        return context

    def _draw(self, context, sampling) -> int:
        return next_token(context, sampling.base_key, sampling.temperature > 0)

    def run(self, out: SchedulerOutput) -> RunnerOutput:
        ps = self.config.page_size
        self.kv.update(self._landing)  # the last run's page-ins ahead land before this run reads anything
        self._landing = {}
        out_copies = {h * ps + o: self.kv.get(d * ps + o) for d, h in zip(*out.swap_out) for o in range(ps)}
        self.host.update({k: v for k, v in out_copies.items() if v is not None})
        for h, d in zip(*out.swap_in):  # the page's old contents are gone: only a right copy gives the samples
            for o in range(ps):
                self.kv.pop(d * ps + o, None)
                if h * ps + o in self.host:
                    self.kv[d * ps + o] = self.host.pop(h * ps + o)
        # The page holds nothing until the next run, so this one cannot read it; the host copy stays (a staged
        # sequence keeps its host pages until it is admitted, engine/kv/swap.py).
        for h, d in zip(*out.swap_in_ahead):
            for o in range(ps):
                self.kv.pop(d * ps + o, None)
                if h * ps + o in self.host:
                    self._landing[d * ps + o] = self.host[h * ps + o]
        if out.decode is None:
            self._ahead = None
            contexts = []
            for c in out.chunks:
                seq = self.seqs[c.seq_id]
                if c.start == 0 and all(s is not seq for s in self.first_scheduled):
                    self.first_scheduled.append(seq)
                for p, token in enumerate(c.token_ids, c.start):
                    self._write(c.pages, p, token, c.seq_id)
                contexts.append(self._context(c.pages, c.start + c.num_tokens, c.seq_id))
                assert contexts[-1] == tuple(seq.token_ids[:c.start + c.num_tokens]), "the KV lost a token"
            tokens = [self._draw(contexts[i], q) for q, i in zip(out.row_sampling, out.row_chunk)]
            ps = self.config.page_size
            for src, dst in zip(*out.copies):
                for o in range(ps):
                    if src * ps + o in self.kv:
                        self.kv[dst * ps + o] = self.kv[src * ps + o]
            return RunnerOutput(np.array(tokens, np.int32), -np.array(tokens, np.float32) / VOCAB)
        call = out.decode
        if call.resume:
            pending = self._ahead
        else:
            pending = self._decode(list(zip(call.token_ids, call.starts, call.pages, call.limits, call.budgets,
                                            call.sampling, call.seq_ids)))
        self._ahead = None if call.chain_pages is None else self._chain(pending, call.chain_pages)
        return pending[1]

    def _decode(self, rows):
        K = self.config.decode_steps
        tokens, steps = np.zeros((K, len(rows)), np.int32), np.zeros(len(rows), np.int32)
        for r, (token, start, pages, limit, _, seq, seq_id) in enumerate(rows):
            if limit == 0:  # a row done before this call: it writes and reads nothing
                continue
            context = list(self._context(pages, start, seq_id, query=start))  # before the call writes position start
            for i in range(limit):
                self._write(pages, start + i, token, seq_id)
                context.append(token)
                token = self._draw(tuple(context), seq)
                tokens[i, r], steps[r] = token, i + 1
                if token == EOS:
                    break
        _, stopped = stopped_at_a_stop_id(np, tokens, steps, np.full((len(rows), 1), EOS))  # this fake stops at EOS
        return rows, RunnerOutput(tokens, -tokens.astype(np.float32) / VOCAB, steps, stopped=stopped)

    def _chain(self, pending, pages):
        rows, prev = pending
        K, chained = self.config.decode_steps, []
        for r, (token, start, _, limit, remaining, seq, seq_id) in enumerate(rows):
            steps = int(prev.steps[r])
            last = int(prev.tokens[steps - 1, r]) if steps else token
            stopped = steps > 0 and last == EOS
            left = remaining - steps
            live = len(pages[r]) > 0 and limit > 0 and not stopped
            chained.append((last, start + steps, pages[r], min(K, left) if live else 0, left, seq, seq_id))
        return self._decode(chained)

    def reset(self, physical: bool) -> None:
        self._ahead = None
        if physical:
            self.kv.clear()


def reference(request: Request, max_seq_len: int) -> list[int]:
    """The dummy model run on one request alone."""
    context, out = list(request.prompt_token_ids), []
    from engine.sampling.sampler import sample_base_key

    key = sample_base_key(request.sampling.seed, request.prompt_id, request.generation_index)
    while len(out) < request.sampling.max_new_tokens:
        token = next_token(tuple(context), key, request.sampling.temperature > 0)
        out.append(token)
        context.append(token)
        if token == EOS:
            break
    return out


def make_engine(config: EngineConfig, max_seq_len: int = 64, groups: KVGroups | None = None) -> Engine:
    runner = DummyRunner(config, max_seq_len, groups)
    engine = Engine.from_runner(runner, config, VOCAB, {EOS}, groups=groups)
    add = engine.scheduler.add

    def add_and_record(seq) -> None:  # the runner checks its KV against the sequences' tokens
        runner.seqs[seq.arrival] = seq
        add(seq)

    engine.scheduler.add = add_and_record
    return engine


configs = st.builds(
    lambda ps, pages, seqs, prefill_seqs, prefill, k, pipe, host, preemption: EngineConfig(
        page_size=ps, max_pages=max(pages, 64 // ps), max_seqs=seqs, max_seqs_in_prefill=min(prefill_seqs, seqs),
        max_prefill_size=prefill, decode_steps=k, pipeline_decode=pipe, max_seq_len=64, debug_invariants=True,
        host_kv_pages=host, preemption=preemption if host else "recompute"),
    # cleanup_mode stays incremental: with `end` a call larger than the pool stops by design (the last test)
    st.sampled_from([2, 4, 8]), st.integers(8, 48), st.integers(1, 8), st.integers(1, 4), st.integers(1, 64),
    st.integers(1, 4), st.booleans(), st.sampled_from([0, 2, 8, 64]), st.sampled_from(["recompute", "swap", "auto"]))

workloads = st.lists(st.tuples(st.integers(1, 30), st.integers(1, 20), st.integers(1, 3), st.booleans()),
                     min_size=1, max_size=10)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=configs, workload=workloads, split=st.integers(0, 10), data=st.data())
def test_samples_equal_the_dummy_model_alone_and_pages_balance(config, workload, split, data):
    """Whatever the capacities (preemption when pages run short, chunked prefill, forks, multi-step calls
    and calls run ahead), every sample is the one its request gives alone, and after the call no page is held.
    Requests arrive in two groups, the second while the first runs."""
    run_workload(make_engine(config), config, workload, split, data)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=configs, workload=workloads, split=st.integers(0, 10), window=st.sampled_from([1, 3, 4, 7, 13]),
       layers=st.sampled_from([(True, False), (True, True, False), (False, True, True, True, True, True), (True,)]),
       data=st.data())
def test_layer_groups_hold_only_their_window_and_give_the_same_samples(config, workload, split, window, layers, data):
    """The same, with the pool in layer groups (engine/kv/kv_groups.py): sliding groups of `window` tokens beside a
    group of full attention, or one sliding group (Mistral). Every step writes each token to its page in every group and reads each sliding
    group's window back (the dummy runner asserts they hold the tokens), while the manager gives back the pages
    that slid out: the samples are those of the request alone, and the invariants (a given-back page only before
    the window) hold after every step."""
    groups = KVGroups.of([window if sliding else None for sliding in layers])
    engine = make_engine(config, groups=groups)
    run_workload(engine, config, workload, split, data)


def run_workload(engine: Engine, config: EngineConfig, workload, split: int, data) -> None:
    rng = np.random.default_rng(len(workload))
    requests = []
    for i, (length, new, n, sampled) in enumerate(workload):
        n = min(n, config.max_seqs)
        prompt = tuple(int(t) for t in rng.integers(1, VOCAB, length))
        sampling = SamplingConfig(max_new_tokens=min(new, 64 - length), temperature=1.0 if sampled else 0.0, seed=i, n=n)
        requests += [Request(f"p{i}", prompt, sampling, generation_index=g) for g in range(n)]
    done = []
    for r in requests[:split]:
        assert engine.add_request(r) is None
    for _ in range(data.draw(st.integers(0, 5))):
        if engine.has_unfinished:
            done += engine.step()
    for r in requests[split:]:
        assert engine.add_request(r) is None
    while engine.has_unfinished:
        done += engine.step()
        sched = engine.scheduler
        # Pages are held by running and retained sequences, and by waiting ones staged with page-ins issued.
        holders = sched.running + sched.retained + [s for s in sched.waiting if s.staged]
        assert sched.allocator.num_used == len({p for s in holders for p in held(s.pages)})
    assert sorted((c.prompt_id, c.generation_index) for c in done) == sorted((r.prompt_id, r.generation_index)
                                                                           for r in requests)
    by_key = {(c.prompt_id, c.generation_index): c for c in done}
    for r in requests:
        got = by_key[(r.prompt_id, r.generation_index)]
        assert got.token_ids == reference(r, 64), (r.prompt_id, r.generation_index)
        assert got.finish_reason == ("stop" if got.token_ids[-1] == EOS else "length")
    # FIFO: the first sample of each prompt starts its prompt in arrival order unless it was preempted.
    firsts = [s.arrival for s in engine.runner.first_scheduled
              if s.request.generation_index == 0 and s.num_preemptions == 0]
    assert firsts == sorted(firsts)
    engine.release_finished()
    assert engine.scheduler.allocator.num_used == 0 and engine.scheduler.allocator.max_refcount == 0
    swapper = engine.scheduler.swapper  # no sequence is swapped out: the host pool holds the host tier's pages only
    assert swapper.host.num_used == len(swapper.cache) and (swapper.tiered or not swapper.cache)
    assert swapper.host.peak_used <= swapper.host.num_pages
    engine.reset()
    assert swapper.host.num_used == 0
    engine.scheduler.allocator.check()


def test_siblings_share_full_prompt_pages_and_copy_the_partial_one():
    config = EngineConfig(page_size=4, max_pages=32, max_seqs=4, max_seqs_in_prefill=4, max_seq_len=64, decode_steps=1)
    engine = make_engine(config)
    sampling = SamplingConfig(max_new_tokens=3, temperature=1.0, n=3)
    for g in range(3):
        engine.add_request(Request("p", tuple(range(1, 11)), sampling, generation_index=g))  # 10 tokens: 2 full pages
    assert len(engine.scheduler.waiting) == 1  # the samples of one prompt queue as one sequence
    engine.step()
    seqs = engine.scheduler.running
    alloc = engine.scheduler.allocator
    assert len(seqs) == 3 and all(len(q.token_ids) == 11 for q in seqs)
    assert {tuple(q.pages[0][:2]) for q in seqs} == {tuple(seqs[0].pages[0][:2])}
    assert [alloc.refcount(p) for p in seqs[0].pages[0][:2]] == [3, 3]
    assert len({q.pages[0][2] for q in seqs}) == 3 and all(alloc.refcount(q.pages[0][2]) == 1 for q in seqs)


def test_preemption_frees_pages_and_recompute_restores_the_samples():
    """Too few pages for every sequence at full length: the newest is preempted and recomputed later."""
    config = EngineConfig(page_size=2, max_pages=32, max_seqs=4, max_seqs_in_prefill=4, max_seq_len=64,
                          decode_steps=2, debug_invariants=True)
    engine = make_engine(config)
    requests = [Request(f"p{i}", tuple(range(1 + i, 13 + i)), SamplingConfig(max_new_tokens=20)) for i in range(4)]
    done = engine.generate(requests)
    assert engine.scheduler.num_preemptions > 0
    assert [c.token_ids for c in done] == [reference(r, 64) for r in requests]
    assert engine.scheduler.allocator.num_used == 0


def test_multi_step_reservations_are_released():
    config = EngineConfig(page_size=4, max_pages=64, max_seqs=4, max_seqs_in_prefill=4, max_seq_len=64, decode_steps=4)
    engine = make_engine(config)
    requests = [Request(f"p{i}", (5 + i, 6, 7), SamplingConfig(max_new_tokens=30, temperature=1.0, seed=i))
                for i in range(4)]
    done = engine.generate(requests, reset=False)
    assert engine.scheduler.num_pipelined_calls > 0
    assert [c.token_ids for c in done] == [reference(r, 64) for r in requests]
    assert engine.scheduler.allocator.num_used == 0


def test_nothing_fits_is_an_answer_with_the_fix():
    config = EngineConfig(page_size=4, max_pages=16, max_seqs=2, max_seqs_in_prefill=2, max_seq_len=64, cleanup_mode="none")
    engine = make_engine(config)
    engine.generate([Request("a", tuple(range(1, 50)), SamplingConfig(max_new_tokens=8))], reset=False)
    engine.add_request(Request("b", tuple(range(1, 50)), SamplingConfig(max_new_tokens=8)))
    with pytest.raises(RuntimeError, match="cleanup_mode=incremental"):
        engine.step()



def test_a_sequence_that_cannot_grow_beside_retained_pages_is_stuck_not_recomputed_forever():
    """cleanup_mode=end: finished sequences keep their pages until the call ends. A sequence that, running alone,
    outgrew what they leave was preempted, readmitted, recomputed and preempted again without end (a random
    workload found it: forked samples finishing one by one leave their pages behind)."""
    config = EngineConfig(page_size=2, max_pages=32, max_seqs=5, max_seqs_in_prefill=3, max_prefill_size=18,
                          max_seq_len=64, decode_steps=3, cleanup_mode="end", prefix_caching=False)
    engine = make_engine(config)
    run, calls = engine.runner.run, []

    def counted(out):
        calls.append(1)
        assert len(calls) < 300, "no progress: the same sequence is preempted and recomputed again and again"
        return run(out)

    engine.runner.run = counted
    head = (30, 25, 13)
    rows = [((27, 22, 31, 33, 20, 35, 30, 10, 35, 22, 21, 17, 22), 6, 1, 0.0),
            ((11, 12, 17, 9, 26, 26, 10, 29, 37, 13), 16, 2, 0.0), ((22, 10, 29, 36, 20), 14, 2, 0.8),
            ((32, 36), 11, 2, 0.0), ((33, 34, 8, 18, 11, 20, 33, 23, 24, 14, 15), 16, 3, 0.0),
            ((34, 30, 11, 27, 12, 25, 24, 28, 38, 16, 15), 2, 1, 0.8), ((39, 17, 22, 38, 14, 34, 28, 34, 30, 9, 22), 5, 3, 0.0),
            ((36, 29, 24, 20, 19, 31, 22, 17, 33, 18, 16, 36, 21), 17, 1, 0.8)]
    requests = [Request(f"p{i}", head + tail, SamplingConfig(max_new_tokens=new, n=n, temperature=t, seed=94), g)
                for i, (tail, new, n, t) in enumerate(rows) for g in range(n)]
    with pytest.raises(RuntimeError, match="cleanup_mode=incremental"):
        engine.generate(requests)


# -- the prefix cache ------------------------------------------------------------------------------

prefixed_workloads = st.lists(st.tuples(st.integers(0, 2), st.integers(0, 12), st.integers(1, 16), st.integers(1, 3),
                                        st.booleans()), min_size=1, max_size=12)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=configs, workload=prefixed_workloads, split=st.integers(0, 12), calls=st.integers(1, 2), data=st.data())
def test_prompts_sharing_prefixes_give_the_same_samples_with_the_cache_on_and_off(config, workload, split, calls, data):
    """Prompts behind one of three shared prefixes (up to 40 tokens, several pages), arriving in two groups and
    over one or two calls: with the cache on, every sample is the one its request gives alone (the dummy
    runner reads each token back through the page table, so a page mapped from the cache that holds other
    tokens changes the sample), every step keeps the allocator's invariants, and the cache served tokens
    whenever a prompt's leading full page was computed before it was admitted."""
    rng = np.random.default_rng(len(workload))
    prefixes = [tuple(int(t) for t in rng.integers(1, VOCAB, n)) for n in (40, 24, 9)]
    requests = []
    for i, (which, extra, new, n, sampled) in enumerate(workload):
        n = min(n, config.max_seqs)
        prompt = prefixes[which] + tuple(int(t) for t in rng.integers(1, VOCAB, extra))
        sampling = SamplingConfig(max_new_tokens=min(new, 63 - len(prompt)), temperature=1.0 if sampled else 0.0,
                                  seed=i, n=n)
        requests += [Request(f"p{i}", prompt, sampling, generation_index=g) for g in range(n)]
    # The pool holds every prompt and its samples at once, so no cached page is ever reclaimed. (When it does not,
    # a call may reclaim every page the previous call cached before anything reads it: no hit is owed then.)
    fits = sum(pages_needed(len(r.prompt_token_ids), r.sampling.max_new_tokens, config.page_size, r.sampling.n)
               for r in requests if r.generation_index == 0) <= config.max_pages
    results = {}
    for caching in (True, False):
        engine = make_engine(dataclasses.replace(config, prefix_caching=caching))
        done, hits = [], 0
        for call in range(calls):
            for r in requests[:split]:
                assert engine.add_request(r) is None
            for _ in range(data.draw(st.integers(0, 5))) if caching and call == 0 else ():
                if engine.has_unfinished:
                    done += engine.step()
            for r in requests[split:]:
                assert engine.add_request(r) is None
            while engine.has_unfinished:
                done += engine.step()
            engine.settle()
            hits += engine.stats.prefix_cache_hit_tokens
            engine.stats.clear()
            assert engine.scheduler.allocator.num_used == 0
            engine.scheduler.allocator.check()
        for c in done:
            request = next(r for r in requests if (r.prompt_id, r.generation_index) == (c.prompt_id, c.generation_index))
            assert c.token_ids == reference(request, 64), (c.prompt_id, c.generation_index, caching)
        results[caching] = sorted((c.prompt_id, c.generation_index, tuple(c.token_ids)) for c in done)
        if not caching:
            assert hits == 0 and engine.scheduler.allocator.num_cached == 0
        elif calls == 2 and any(len(r.prompt_token_ids) > config.page_size for r in requests) and fits:
            assert hits > 0  # the second call finds the first call's pages: nothing needed to evict them
    assert results[True] == results[False]


def test_a_prompt_whose_prefix_was_evicted_recomputes_it():
    """A pool that holds one prompt: the second prompt reclaims the first's cached pages, and the first sent
    again computes its prefix anew, with the same samples."""
    config = EngineConfig(page_size=4, max_pages=11, max_seqs=1, max_seqs_in_prefill=1, max_seq_len=44,
                          debug_invariants=True)
    engine = make_engine(config, max_seq_len=44)
    a = Request("a", tuple(range(1, 37)), SamplingConfig(max_new_tokens=8))
    b = Request("b", tuple(range(2, 38)), SamplingConfig(max_new_tokens=8))
    first = engine.generate([a])[0].token_ids
    assert engine.scheduler.allocator.num_cached == 9  # 36 prompt tokens: 9 full pages, all cached
    assert engine.generate([a])[0].token_ids == first
    assert engine.stats.prefix_cache_hit_tokens == 32  # the last page is recomputed for the last token's logits
    engine.generate([b])  # 44 tokens: 11 pages, so a's 9 cached pages are reclaimed
    assert engine.scheduler.allocator.lookup((-1, tuple(range(1, 5)))) is None
    assert engine.generate([a])[0].token_ids == first == reference(a, 44)
    assert engine.stats.prefix_cache_hit_tokens == 0
    engine.reset()
    assert engine.scheduler.allocator.num_cached == 0


def test_a_later_sequence_of_the_same_step_maps_the_pages_an_earlier_one_computes():
    config = EngineConfig(page_size=4, max_pages=64, max_seqs=4, max_seqs_in_prefill=4, max_prefill_size=64,
                          max_seq_len=64, decode_steps=1)
    engine = make_engine(config)
    prefix = tuple(range(1, 21))  # 5 full pages
    requests = [Request(f"p{i}", prefix + (30 + i,), SamplingConfig(max_new_tokens=4)) for i in range(3)]
    for r in requests:
        engine.add_request(r)
    out, counts = engine.scheduler.schedule()
    assert [c.num_tokens for c in out.chunks] == [21, 1, 1]  # the two later prompts compute only their last token
    assert counts.cache_query_tokens == 63 and counts.cache_hit_tokens == 40
    assert [c.pages[0][:5] for c in out.chunks[1:]] == [out.chunks[0].pages[0][:5]] * 2
    engine.scheduler.reset()
    assert [c.token_ids for c in make_engine(config).generate(requests)] == [reference(r, 64) for r in requests]


def test_a_prompt_served_from_the_cache_but_its_last_token_counts_its_hit_in_a_multi_step_call():
    """A prompt cached up to its last token decodes from its first step (a multi-step call): that step
    still reports its lookup and its hit (the counters once went only with ragged steps)."""
    config = EngineConfig(page_size=2, max_pages=32, max_seqs=1, max_seqs_in_prefill=1, max_prefill_size=1,
                          max_seq_len=64, decode_steps=2, debug_invariants=True)
    engine = make_engine(config)
    request = Request("a", tuple(range(1, 40)) + (1, 2), SamplingConfig(max_new_tokens=3))
    first = engine.generate([request])[0].token_ids
    assert len(first) == 3
    engine.stats.clear()
    assert engine.generate([request])[0].token_ids == first
    assert (engine.stats.prefix_cache_query_tokens, engine.stats.prefix_cache_hit_tokens) == (41, 40)
