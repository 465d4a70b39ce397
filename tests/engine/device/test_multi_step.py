"""Multi-step decode (engine.decode_steps): the same samples as one decode step per device call."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from engine.device import multi_step as multi_step_module
from engine.config import EngineConfig, SamplingConfig
from engine.distributed import slice_mesh
from engine.engine import Engine
from engine.record import SampleRecord as Completion
from engine.models.presets import write_model
from engine.scheduling.sequence import Request
from engine.stats import EngineStats

GREEDY = SamplingConfig(max_new_tokens=13, temperature=0.0, logprobs=True)
SEEDED = SamplingConfig(max_new_tokens=13, temperature=0.8, top_p=0.9, top_k=50, seed=3, n=2, logprobs=True)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return write_model("tiny-llama", tmp_path_factory.mktemp("tiny-llama"))


def prompts() -> list[tuple[int, ...]]:
    rng = np.random.default_rng(0)
    return [tuple(rng.integers(6, 512, int(n)).tolist()) for n in (3, 17, 40, 9, 33, 5)]


def with_max_new(s: SamplingConfig, max_new_tokens: int, **kw) -> SamplingConfig:
    return dataclasses.replace(s, max_new_tokens=max_new_tokens, **kw)


def groups(stop: str) -> list[list[Request]]:
    """Batches of at most 4 rows: every row decodes in a batch of one shape (the 4-row bucket) in every mode.

    A row's float32 logits depend, in their last bits, on the padded batch size its step ran in; keeping
    it fixed is what lets the logprobs of different modes be compared exactly.
    """
    p = prompts()
    greedy = [Request(f"g{i}", p[i], with_max_new(GREEDY, m)) for i, m in zip((0, 1, 2, 3), (1, 2, 13, 7))]
    seeded = [Request(f"s{i}", p[i], with_max_new(SEEDED, m), g) for i, m in ((2, 11), (4, 21)) for g in range(2)]
    mixed = [Request("short", p[5], with_max_new(SEEDED, 2, n=1)), Request("one", p[3], with_max_new(GREEDY, 1)),
             Request("stop", p[4], with_max_new(GREEDY, 24, stop=[stop])),
             Request("long", p[1], with_max_new(SEEDED, 9, n=1))]
    return [greedy, seeded, mixed]


def run(path, decode_steps: int, batches: list[list[Request]], **config) -> tuple[list[Completion], Engine]:
    engine = Engine(path, EngineConfig(**{"page_size": 8, "max_pages": 64, "max_seqs": 4, "max_seqs_in_prefill": 4,
                                          "max_prefill_size": 256, "max_seq_len": 128, "decode_steps": decode_steps,
                                          "debug_invariants": True, **config}))
    out, calls = [], EngineStats()
    for batch in batches:
        out += engine.generate(batch, reset=False)
        for name, values in vars(engine.stats).items():  # each call's stats start afresh: keep every call's steps
            if isinstance(values, list):
                getattr(calls, name).extend(values)
    engine.stats = calls
    return out, engine


def mid_call_stop(path) -> tuple[str, int]:
    """A stop string completed by a generated token that is neither the first nor the last of a 4- or 8-step call
    (the first token comes from the prompt's step, then calls make tokens 2-5, 6-9, ... or 2-9, 10-17)."""
    engine = Engine(path, EngineConfig(max_pages=64, max_seq_len=128, decode_steps=1))
    ids = engine.generate([Request("stop", prompts()[4], with_max_new(GREEDY, 24))])[0].token_ids
    text = engine.tokenizer.decode
    for count in (3, 4, 7, 8, 11, 12):
        piece = text(ids[count - 1:count])
        if piece.strip() and "\ufffd" not in piece and piece not in text(ids[:count - 1]) and piece in text(ids[:count]):
            return piece, count
    raise AssertionError("no generated token makes a usable stop string; change the prompt")


def test_decode_steps_give_the_samples_of_single_steps(tiny_llama):
    stop, stop_at = mid_call_stop(tiny_llama)
    batches = groups(stop)
    ref, single = run(tiny_llama, 1, batches)
    assert max(single.stats.model_steps) == 1
    by_id = {(c.prompt_id, c.generation_index): c for c in ref}
    # The cases are there: limits of 1 and 2 tokens, an EOS, a stop string mid-call, n=2 samples that differ.
    assert [len(by_id[(i, 0)].token_ids) for i in ("g0", "g1", "one", "short")] == [1, 2, 1, 2]
    assert any(c.finish_reason == "stop" and c.token_ids[-1] in single.eos_token_ids for c in ref)
    assert by_id[("stop", 0)].finish_reason == "stop" and len(by_id[("stop", 0)].token_ids) == stop_at
    assert by_id[("s4", 0)].token_ids != by_id[("s4", 1)].token_ids
    for k, pipeline in ((4, True), (8, True), (4, False)):
        got, engine = run(tiny_llama, k, batches, pipeline_decode=pipeline)
        assert got == ref, f"decode_steps={k}"  # token ids, logprobs (exactly), text and finish reasons
        stats = engine.stats
        assert max(stats.model_steps) == k, "the multi-step path must have run"
        # Each batch fills every slot: nothing waits, so calls are dispatched ahead of the host's reading.
        assert (engine.scheduler.num_pipelined_calls > 0) == pipeline
        assert len(stats.step_s) < sum(stats.decode_tokens)
        # The stop string fired mid-call: the tokens generated after it were dropped.
        assert sum(stats.decode_tokens) > sum(len(c.token_ids) for c in got)
        assert engine.scheduler.allocator.num_used == 0


def test_page_pressure_falls_back_to_single_steps(tiny_llama):
    """Few pages and more requests than slots: a multi-step call's pages are not always free, so some
    decode-only steps run singly (and preempt); the tokens are still those of single steps."""
    p = prompts()
    requests = [Request(f"r{i}", p[i % len(p)] + (i,), with_max_new(SEEDED if i % 2 else GREEDY, 5 + 3 * i, n=1))
                for i in range(8)]
    config = {"page_size": 4, "max_pages": 24, "max_seq_len": 96}
    ref, single = run(tiny_llama, 1, [requests], **config)
    got, engine = run(tiny_llama, 4, [requests], **config)
    assert engine.scheduler.num_multi_step_fallbacks > 0 and max(engine.stats.model_steps) == 4
    assert [(c.token_ids, c.finish_reason, c.completion) for c in got] == \
        [(c.token_ids, c.finish_reason, c.completion) for c in ref]
    # Admissions and preemptions now fall at other points of each row's decode, so some of its steps run in
    # batches of other shapes (mixed prefill steps, other buckets): the logprobs are still bit-identical.
    assert [c.logprobs for c in got] == [c.logprobs for c in ref]
    assert engine.scheduler.allocator.num_used == 0


def test_requests_added_while_a_call_runs_ahead_join_after_it(tiny_llama):
    """The orchestrator feeds the engine between steps: a request that arrives while a multi-step call is
    dispatched ahead waits for it, and every sample is still the one its request gives alone."""
    p = prompts()
    first = [Request(f"a{i}", p[i], with_max_new(SEEDED if i % 2 else GREEDY, 30, n=1)) for i in range(2)]
    late = [Request(f"b{i}", p[i + 2], with_max_new(SEEDED if i % 2 else GREEDY, 12, n=1)) for i in range(3)]
    alone = {c.prompt_id: c for r in first + late for c in run(tiny_llama, 1, [[r]])[0]}
    engine = Engine(tiny_llama, EngineConfig(page_size=8, max_pages=64, max_seqs=4, max_seqs_in_prefill=4,
                                             max_prefill_size=256, max_seq_len=128, decode_steps=4,
                                             debug_invariants=True))
    done = [c for r in first for c in [engine.add_request(r)] if c is not None]
    while engine.scheduler.call_ahead is None:
        done += engine.step()
    for r in late:
        engine.add_request(r)
    pipelined = engine.scheduler.num_pipelined_calls
    done += engine.step()  # reads the call ahead, dispatches nothing more: the new requests wait
    assert engine.scheduler.call_ahead is None and engine.scheduler.num_pipelined_calls == pipelined and engine.num_waiting > 0
    while engine.has_unfinished:
        done += engine.step()
    assert sorted(c.prompt_id for c in done) == sorted(alone)
    for c in done:
        ref = alone[c.prompt_id]
        assert (c.token_ids, c.finish_reason, c.completion) == (ref.token_ids, ref.finish_reason, ref.completion)
        assert c.logprobs == ref.logprobs  # other batch shapes, the same bits
    assert engine.scheduler.num_pipelined_calls > pipelined  # the late ones ran ahead too once nothing waited
    engine.release_finished()
    engine.reset()
    assert engine.scheduler.allocator.num_used == 0


def test_no_call_runs_ahead_when_every_row_ends_in_the_one_before(tiny_llama, monkeypatch):
    """A call continues the rows of the call before it only when some row can still generate after that
    one: rows that reach max_new_tokens there end there, and a call after them would find nothing to do."""
    p = prompts()
    requests = [Request(f"short{i}", p[i % 6], with_max_new(GREEDY, 5)) for i in range(12)]
    requests += [Request(f"long{i}", p[i], with_max_new(GREEDY, 21)) for i in range(2)]
    shapes = dict(max_seqs=16, max_seqs_in_prefill=16, max_pages=128)
    expected, _ = run(tiny_llama, 4, [requests], **shapes, pipeline_decode=False)
    engine = Engine(tiny_llama, EngineConfig(page_size=8, max_prefill_size=256, max_seq_len=128, decode_steps=4,
                                             debug_invariants=True, **shapes))
    calls, launch = [], engine.runner._launch

    def counted(token_ids, starts, limits, *args):
        calls.append(int(np.sum(np.asarray(limits) > 0)))  # rows that take steps in the call
        return launch(token_ids, starts, limits, *args)

    monkeypatch.setattr(engine.runner, "_launch", counted)
    got = engine.generate(requests)
    for c, ref in zip(got, expected, strict=True):
        assert (c.prompt_id, c.token_ids, c.finish_reason) == (ref.prompt_id, ref.token_ids, ref.finish_reason)
        assert c.logprobs == ref.logprobs  # other batch shapes, the same bits
    # The first token comes from the prompt's step, then 4 a call: the short rows end in the first call,
    # the long ones in the fifth, which nothing follows.
    assert calls == [14, 2, 2, 2, 2] and engine.scheduler.num_pipelined_calls == 4


@pytest.mark.parametrize("model_axis", [None, 2])
def test_a_call_and_the_calls_chained_to_it_share_one_program(tiny_llama, model_axis):
    """The first call of a run of pipelined calls gets its rows from the host, the next ones from the
    device: both must hit the same compiled program (a second signature compiles it again, ~1 s a shape on
    a machine's first job), on one device and on a mesh."""
    p = prompts()
    requests = [Request(f"r{i}", p[i], with_max_new(GREEDY, 17)) for i in range(3)]
    mesh = None if model_axis is None else slice_mesh(model_axis)
    engine = Engine(tiny_llama, EngineConfig(page_size=8, max_pages=64, max_seqs=4, max_seqs_in_prefill=4,
                                             max_prefill_size=256, max_seq_len=128, decode_steps=4), mesh=mesh)
    multi_step_module._steps_sample.clear_cache()
    multi_step_module._chain.clear_cache()
    engine.generate(requests)
    assert engine.scheduler.num_pipelined_calls >= 2
    assert multi_step_module._steps_sample._cache_size() == 1 and multi_step_module._chain._cache_size() == 1


def test_decode_steps_must_be_positive():
    with pytest.raises(ValueError, match="engine.decode_steps must be at least 1"):
        EngineConfig(decode_steps=0)


def test_a_greedy_job_leaves_sampling_out_of_its_programs(tiny_llama, monkeypatch):
    """Greedy steps compile without sort, cumsum and threefry (about half of a step program's compile time);
    the samples, logprobs included, are those of the sampling program."""
    import engine.device.device_calls
    import engine.device.multi_step
    import engine.device.runner

    p = prompts()
    requests = [Request(f"g{i}", p[i], with_max_new(GREEDY, 9)) for i in range(3)]
    # Shapes no other test uses (max_seqs=3, 24-token prompt budget): these programs are traced here, fresh.
    shapes = dict(max_seqs=3, max_seqs_in_prefill=3, max_prefill_size=24)
    with monkeypatch.context() as m:
        for module in (engine.device.runner, engine.device.multi_step):  # single steps and multi-step calls
            m.setattr(module, "_sampling_mode", lambda rows, vocab: "truncate")  # the full sampling program
        expected, _ = run(tiny_llama, 4, [requests], **shapes, max_pages=60)

    def no_sampling(*args, **kwargs):
        raise AssertionError("a sampling program was traced")

    monkeypatch.setattr(engine.device.device_calls, "sample", no_sampling)
    got, _ = run(tiny_llama, 4, [requests], **shapes, max_pages=62)  # new pool shape: traced again
    assert got == expected
    with pytest.raises(AssertionError, match="sampling program was traced"):  # the patch does bite
        run(tiny_llama, 4, [[Request("s", p[0], with_max_new(SEEDED, 3, n=1))]], **shapes, max_pages=62)


def test_a_job_without_top_k_or_top_p_leaves_the_sort_out(tiny_llama, monkeypatch):
    import engine.device.multi_step
    import engine.device.runner
    import engine.sampling.sampler

    p = prompts()
    plain = SamplingConfig(max_new_tokens=9, temperature=0.9, seed=5, n=2, logprobs=True)  # top_k, top_p off
    requests = [Request(f"t{i}", p[i], plain, g) for i in range(2) for g in range(2)]
    shapes = dict(max_seqs=3, max_seqs_in_prefill=3, max_prefill_size=24)
    with monkeypatch.context() as m:
        for module in (engine.device.runner, engine.device.multi_step):
            m.setattr(module, "_sampling_mode", lambda rows, vocab: "truncate")
        expected, _ = run(tiny_llama, 4, [requests], **shapes, max_pages=64)

    def no_sort(*args, **kwargs):
        raise AssertionError("the top-k/top-p sort was traced")

    monkeypatch.setattr(engine.sampling.sampler, "_truncate_row", no_sort)
    got, _ = run(tiny_llama, 4, [requests], **shapes, max_pages=66)
    assert got == expected
    with pytest.raises(AssertionError, match="sort was traced"):
        run(tiny_llama, 4, [[Request("k", p[0], dataclasses.replace(plain, top_p=0.9))]], **shapes, max_pages=66)
