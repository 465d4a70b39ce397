"""Page-ins a step ahead (engine/kv/swap.py's staging): a swapped-out sequence or a prefix continuing in the host tier,
admitted while others run, has its page-ins issued in a step before the first step that reads its pages; the
copy runs behind that earlier step's compute, and the samples stay those of an ample pool."""

from __future__ import annotations

import numpy as np
import pytest

from engine.config import EngineConfig, SamplingConfig
from engine.engine import Engine
from engine.models.presets import write_model
from engine.scheduling.sequence import Request
from tests.engine.scheduling.test_scheduler import VOCAB, make_engine, reference


def _requests(vocab: int, seed: int = 5, n: int = 6, new: int = 30) -> list[Request]:
    rng = np.random.default_rng(seed)
    sampling = SamplingConfig(max_new_tokens=new, temperature=0.0, logprobs=True)
    return [Request(f"r{i}", tuple(rng.integers(6, vocab, int(rng.integers(4, 20))).tolist()), sampling)
            for i in range(n)]


def _record_reads(engine) -> list[tuple[list[int], set[int]]]:
    """Per device call: its page-ins issued ahead (device pages) and the pages its sequences read."""
    calls, run = [], engine.runner.run

    def recording(out):
        pages = [c.pages for c in out.chunks] if out.decode is None else out.decode.pages
        calls.append((list(out.swap_in_ahead[1]), {p for q in pages for group in q for p in group}))
        return run(out)

    engine.runner.run = recording
    return calls


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_a_page_in_is_issued_a_step_before_the_step_that_reads_it(prefix_caching):
    """Over the dummy runner (test_scheduler.py), whose page-ins ahead land only at the next call: a pool too small
    for the workload swaps, each page paged in ahead is unread by the call that issues it and read by a later
    one, and the samples are each request's alone."""
    config = EngineConfig(page_size=4, max_pages=16, max_seqs=4, max_seqs_in_prefill=2, max_prefill_size=16,
                          max_seq_len=64, debug_invariants=True, host_kv_pages=64, preemption="swap",
                          prefix_caching=prefix_caching)
    engine = make_engine(config)
    calls = _record_reads(engine)
    requests = _requests(VOCAB)
    out = {c.prompt_id: c.token_ids for c in engine.generate(requests)}
    assert all(out[r.prompt_id] == reference(r, 64) for r in requests)
    assert engine.stats.kv_pages_in_ahead > 0 and engine.scheduler.swapper.pages_in_ahead > 0
    assert engine.stats.recompute_tokens == 0
    for t, (ahead, _) in enumerate(calls):
        for page in ahead:
            assert page not in calls[t][1], f"call {t} read page {page} it paged in ahead"
            assert any(page in read for _, read in calls[t + 1:]), f"page {page} paged in at call {t} is never read"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_model("tiny-llama", tmp_path_factory.mktemp("tiny-llama"))


def test_on_a_real_model_the_copy_starts_a_call_before_it_lands(model):
    """The runner sends a page-in ahead's block with the call that issues it (asynchronously) and writes it into
    the pool only at the next call: the samples, tokens and logprobs, are an ample pool's bit for bit."""
    def engine(**kw):
        return Engine(model, EngineConfig(page_size=8, max_seqs=6, max_seqs_in_prefill=3, max_prefill_size=32,
                                          max_seq_len=96, debug_invariants=True, **kw))

    requests = _requests(512, seed=11, new=48)
    ample = {c.prompt_id: (c.token_ids, c.logprobs) for c in engine(max_pages=200).generate(requests)}
    eng = engine(max_pages=16, host_kv_pages=64, preemption="swap")
    kv, events, run = eng.runner.kv, [], eng.runner.run
    issue, land = kv.page_in_ahead, kv.land_page_ins
    kv.page_in_ahead = lambda h, d: (events.append(("issue", tuple(d))), issue(h, d))[1]
    kv.land_page_ins = lambda: (events.append(("land", tuple(p for _, dst in kv._pending_in for p in dst))), land())[1]
    eng.runner.run = lambda out: (events.append(("call", None)), run(out))[1]
    got = {c.prompt_id: (c.token_ids, c.logprobs) for c in eng.generate(requests)}
    assert got == ample
    assert eng.stats.kv_pages_in_ahead > 0 and eng.stats.recompute_tokens == 0
    issued = [(i, d) for i, (kind, d) in enumerate(events) if kind == "issue" and d]
    assert issued
    landed = 0
    for i, pages in issued:
        nxt = next(j for j in range(i + 1, len(events)) if events[j][0] == "call")
        assert all(kind != "land" or not d for kind, d in events[i + 1:nxt]), "landed in the call that issued it"
        kind, d = events[nxt + 1]  # the next call writes them into the pool before anything else
        assert kind == "land" and set(d) <= set(pages)
        landed += len(d)  # (a page whose page-out is still in flight comes from its device block at once)
    assert landed > 0


def test_a_host_tier_prefix_hit_is_paged_in_a_step_ahead():
    """The prefix cache's host tier alone (preemption recompute: nothing swaps): prompts on a prefix the device
    reclaimed page it back in from the host a call before the call that reads it, while other prompts run."""
    config = EngineConfig(page_size=4, max_pages=10, max_seqs=2, max_seqs_in_prefill=1, max_prefill_size=8,
                          max_seq_len=64, debug_invariants=True, host_kv_pages=64, preemption="recompute")
    engine = make_engine(config)
    calls = _record_reads(engine)
    rng = np.random.default_rng(3)
    x, y = (tuple(rng.integers(1, VOCAB, 13).tolist()) for _ in range(2))  # 3 full pages of 4, and 1 token
    sampling = SamplingConfig(max_new_tokens=6, temperature=0.0)

    def call(name, prefix):
        return [Request(f"{name}{i}", prefix + tuple(rng.integers(1, VOCAB, 1 + i).tolist()), sampling)
                for i in range(4)]

    running = Request("z", tuple(rng.integers(1, VOCAB, 3).tolist()), sampling)  # runs while c's prompts page in
    for requests in (call("a", x), call("b", y), [running, *call("c", x)]):  # b reclaims a's prefix: it spills
        out = {c.prompt_id: c.token_ids for c in engine.generate(requests)}
        assert all(out[r.prompt_id] == reference(r, 64) for r in requests)
    assert engine.scheduler.swapper.num_swaps == 0 and engine.stats.kv_pages_in_ahead > 0
    for t, (ahead, _) in enumerate(calls):
        for page in ahead:
            assert page not in calls[t][1] and any(page in read for _, read in calls[t + 1:])
