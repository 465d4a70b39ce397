"""sampling.min_tokens and sampling.ignore_eos, as vLLM has them: min_tokens holds the stop ids (EOS ids and
sampling.stop_token_ids) back until that many tokens are generated (transformers' min_new_tokens, logprobs the
model's) and keeps stop strings from ending before; ignore_eos lets a sample run past the EOS ids, its own stop ids
still ending it. Single and multi-step decode, and a row's samples alone or batched with others."""

from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import pytest
import torch

from engine.config import EngineConfig, SamplingConfig
from engine.engine import Engine
from engine.scheduling.sequence import Request
from engine.scheduling.stop import StopChecker
from tests.engine.models.hf_reference import make_hf_model

VOCAB = 256
NEW = 24
PROMPTS = [[5, 9, 14, 3, 77, 21], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51], [200, 13, 13, 7]]


def engine(path, decode_steps: int) -> Engine:
    return Engine(path, EngineConfig(page_size=8, max_pages=128, max_seqs=4, max_seqs_in_prefill=4,
                                     max_prefill_size=256, max_seq_len=256, decode_steps=decode_steps))


@pytest.fixture(scope="module")
def model_with_eos(tmp_path_factory):
    """A tiny Llama whose EOS id (config.json and generation_config.json) is a token its greedy sample of PROMPTS[0]
    draws at index STOP_AT >= 2 for the first time: (path, transformers model, free tokens, the EOS id, its index)."""
    base = tmp_path_factory.mktemp("base")
    model = make_hf_model("llama3", base, vocab=VOCAB)
    free = engine(base, 1).generate([Request("a", tuple(PROMPTS[0]), SamplingConfig(max_new_tokens=NEW))])[0]
    assert len(free.token_ids) == NEW, "the base model's EOS (2) ended the free sample: pick other prompts"
    at = next(i for i in range(2, NEW - 6) if free.token_ids[i] not in free.token_ids[:i])
    eos = free.token_ids[at]
    path = tmp_path_factory.mktemp("eos")
    for f in base.iterdir():
        shutil.copy(f, path / f.name)
    for name in ("config.json", "generation_config.json"):
        config = json.loads((path / name).read_text())
        config["eos_token_id"] = eos
        (path / name).write_text(json.dumps(config))
    return path, model, free.token_ids, eos, at


def hf_greedy(model, prompt: list[int], eos: list[int], min_new_tokens: int) -> tuple[list[int], np.ndarray]:
    """transformers' greedy `generate` with min_new_tokens, stopping at `eos`: (tokens, raw logprobs of each)."""
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         do_sample=False, max_new_tokens=NEW, min_new_tokens=min_new_tokens, eos_token_id=eos,
                         pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    logprobs = [torch.log_softmax(lg[0].double(), -1)[t].item() for lg, t in zip(out.logits, tokens)]
    return tokens, np.array(logprobs)


@pytest.mark.parametrize("decode_steps", [1, 4])
def test_eos_is_held_back_until_min_tokens_as_transformers_min_new_tokens(model_with_eos, decode_steps):
    path, model, free, eos, at = model_with_eos
    eng = engine(path, decode_steps)
    plain = eng.generate([Request("a", tuple(PROMPTS[0]), SamplingConfig(max_new_tokens=NEW))])[0]
    assert plain.token_ids == free[:at + 1] and plain.finish_reason == "stop"  # the EOS id ends it
    for min_tokens in (at + 1, at + 4, NEW):
        sampling = SamplingConfig(max_new_tokens=NEW, min_tokens=min_tokens, logprobs=True)
        got = eng.generate([Request("a", tuple(PROMPTS[0]), sampling)])[0]
        tokens, logprobs = hf_greedy(model, PROMPTS[0], [eos], min_tokens)
        assert got.token_ids == tokens and len(tokens) >= min_tokens
        assert eos not in got.token_ids[:min_tokens]
        assert got.finish_reason == ("stop" if got.token_ids[-1] == eos else "length")
        # The held-back position's logprob is the model's (vLLM's raw logprobs), not that of the renormalized rest.
        np.testing.assert_allclose(got.logprobs, logprobs, atol=1e-4)


@pytest.mark.parametrize("decode_steps", [1, 4])
def test_min_tokens_holds_a_rows_own_stop_ids_and_rows_stay_independent(model_with_eos, decode_steps):
    """A row's stop_token_ids are held back too; a min_tokens row with others in its steps (greedy, seeded, penalized)
    gets the tokens and logprobs it gets alone, and the others those they get without it."""
    path, model, free, eos, at = model_with_eos
    eng = engine(path, decode_steps)
    other = next(t for t in free[at + 1:] if t != eos)
    held = SamplingConfig(max_new_tokens=NEW, min_tokens=NEW - 2, stop_token_ids=[other], logprobs=True)
    requests = [Request("held", tuple(PROMPTS[0]), held),
                Request("seeded", tuple(PROMPTS[1]), SamplingConfig(max_new_tokens=NEW, temperature=0.9, seed=3,
                                                                   min_tokens=5, logprobs=True)),
                Request("penalized", tuple(PROMPTS[2]), SamplingConfig(max_new_tokens=NEW, presence_penalty=0.7,
                                                                      logprobs=True))]
    together = eng.generate(requests)
    alone = [eng.generate([r])[0] for r in requests]
    for t, a in zip(together, alone):
        assert t.token_ids == a.token_ids and t.logprobs == a.logprobs
    tokens, _ = hf_greedy(model, PROMPTS[0], [eos, other], NEW - 2)
    assert together[0].token_ids == tokens
    assert not {eos, other} & set(together[0].token_ids[:NEW - 2])


@pytest.mark.parametrize("decode_steps", [1, 4])
def test_ignore_eos_runs_past_the_eos_ids_and_stops_at_its_own(model_with_eos, decode_steps):
    path, _, free, eos, at = model_with_eos
    eng = engine(path, decode_steps)
    past = eng.generate([Request("a", tuple(PROMPTS[0]), SamplingConfig(max_new_tokens=NEW, ignore_eos=True))])[0]
    assert past.token_ids == free and past.finish_reason == "length"
    own = SamplingConfig(max_new_tokens=NEW, ignore_eos=True, stop_token_ids=[eos])
    stopped = eng.generate([Request("a", tuple(PROMPTS[0]), own)])[0]
    assert stopped.token_ids == free[:at + 1] and stopped.finish_reason == "stop"


def test_a_stop_string_ends_only_after_min_tokens():
    """As vLLM: a stop string must end in the text of an id after the first min_tokens; it may begin before."""
    def run(ids: list[int], stop: list[str], min_tokens: int):
        checker = StopChecker(stop_strings=stop, max_new_tokens=len(ids), min_tokens=min_tokens,
                              decode=lambda xs: "".join(chr(ord("a") + x) for x in xs))
        for n in range(1, len(ids) + 1):
            if (decision := checker.push(ids[:n])) is not None:
                return decision
    ids = [1, 2, 0, 1, 2, 3]  # "bcabcd"
    assert run(ids, ["bc"], 0).num_tokens == 2
    found = run(ids, ["bc"], 2)  # the first "bc" ends in id 2's text: not yet; the second one stops it
    assert (found.num_tokens, found.completion, found.finish_reason) == (5, "bca", "stop")
    across = run(ids, ["cab"], 3)  # begins in the first 3 ids' text, ends in the 4th's
    assert (across.num_tokens, across.completion) == (4, "b")
    assert run(ids, ["bc"], 6).finish_reason == "length"


def test_bad_settings_are_refused_in_one_line():
    with pytest.raises(ValueError, match=r"sampling.min_tokens must be in \[0, max_new_tokens = 8\], got 9"):
        SamplingConfig(max_new_tokens=8, min_tokens=9)
    with pytest.raises(ValueError, match="sampling.min_tokens must be in"):
        SamplingConfig(min_tokens=-1)
    with pytest.raises(ValueError, match="ignore_eos cannot be used with a structured output"):
        SamplingConfig(ignore_eos=True, regex="[ab]+")
    assert dataclasses.replace(SamplingConfig(), min_tokens=3).min_tokens == 3


def test_a_job_without_min_tokens_leaves_it_out_of_its_programs(model_with_eos, monkeypatch):
    from engine.device import device_calls
    path = model_with_eos[0]

    def traced(*args, **kwargs):
        raise AssertionError("a min_tokens program was traced")

    monkeypatch.setattr(device_calls, "before_min_tokens", traced)
    plain = SamplingConfig(max_new_tokens=6, temperature=0.8, seed=2)
    eng = Engine(path, EngineConfig(page_size=8, max_pages=70, max_seqs=3, max_seqs_in_prefill=3,
                                    max_prefill_size=24, max_seq_len=256))  # fresh programs
    eng.generate([Request("a", tuple(PROMPTS[0]), plain)])
    with pytest.raises(AssertionError, match="min_tokens program was traced"):
        eng.generate([Request("a", tuple(PROMPTS[0]), dataclasses.replace(plain, min_tokens=2))])


def test_a_rows_own_min_tokens_and_ignore_eos_through_generate(model_with_eos):
    """`pagefleet.generate` rows (as `pagefleet generate` lines and corpus rows carry them) set their own."""
    import pagefleet
    path, model, free, eos, at = model_with_eos
    rows = [{"id": "held", "prompt_token_ids": PROMPTS[0], "sampling": {"min_tokens": at + 4}},
            {"id": "past", "prompt_token_ids": PROMPTS[0], "sampling": {"ignore_eos": True}},
            {"id": "plain", "prompt_token_ids": PROMPTS[0]},
            {"id": "bad", "prompt_token_ids": PROMPTS[0], "sampling": {"ignore_eos": "yes"}}]
    got = {r["prompt_id"]: r for r in pagefleet.generate(str(path), rows, max_new_tokens=NEW)}
    assert got["held"]["token_ids"] == hf_greedy(model, PROMPTS[0], [eos], at + 4)[0]
    assert got["past"]["token_ids"] == free and got["past"]["finish_reason"] == "length"
    assert got["plain"]["token_ids"] == free[:at + 1]
    assert got["bad"]["error"] == "bad_sampling: field 'sampling': ignore_eos is a str, not a boolean"


def test_held_stop_ids_come_back_where_nothing_else_is_left():
    """A structured output that may only end (every other token masked) keeps its stop ids, as vLLM restores them;
    a row past its end, and padding ids (-1), hold nothing back."""
    import jax.numpy as jnp
    from engine.device.device_calls import before_min_tokens

    logits = np.log(np.full((3, 6), 1 / 6, np.float32))
    logits[1, [0, 1, 3, 4]] = -np.inf  # only tokens 2 and 5 allowed: both stop ids
    stop_ids = np.array([[2, 5, -1, -1]] * 3, np.int32)
    out = np.asarray(before_min_tokens(jnp.asarray(logits), jnp.array([4, 4, 9]), jnp.asarray(stop_ids),
                                       jnp.array([8, 8, 8])))
    assert np.isneginf(out[0, [2, 5]]).all() and np.isfinite(out[0, [0, 1, 3, 4]]).all()
    np.testing.assert_array_equal(out[1], logits[1])
    np.testing.assert_array_equal(out[2], logits[2])


def test_min_tokens_and_ignore_eos_on_a_mesh_equal_one_device(model_with_eos):
    """The held stop ids reach every device of a tensor-parallel mesh, single and multi-step."""
    from engine.distributed import slice_mesh

    path, _, _, _, at = model_with_eos
    requests = [Request("held", tuple(PROMPTS[0]), SamplingConfig(max_new_tokens=NEW, min_tokens=at + 3)),
                Request("past", tuple(PROMPTS[1]), SamplingConfig(max_new_tokens=NEW, ignore_eos=True, seed=1,
                                                                 temperature=0.8, min_tokens=4))]
    for steps in (1, 4):
        ref = engine(path, steps).generate(requests)
        got = Engine(path, EngineConfig(page_size=8, max_pages=128, max_seqs=4, max_seqs_in_prefill=4,
                                        max_prefill_size=256, max_seq_len=256, decode_steps=steps),
                     mesh=slice_mesh(2)).generate(requests)
        assert [c.token_ids for c in got] == [c.token_ids for c in ref]
