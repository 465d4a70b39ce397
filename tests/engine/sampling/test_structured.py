"""Structured outputs in the engine: every completion that stops parses (JSON Schema, regex, choice, grammar),
greedy and sampled; a permissive grammar leaves greedy tokens alone; constrained rows do not depend on their
batch, page size or preemption; a grammar that does not compile is the request's error."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest

from engine.config import EngineConfig, SamplingConfig
from engine.engine import Engine
from engine.models.presets import write_model
from engine.scheduling.sequence import Request
from tests.engine.models.hf_reference import varied_prompts

SCHEMA = {
    "type": "object",
    "properties": {
        "label": {"enum": ["cat", "dog", "bird"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "sizes": {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 9}, "maxItems": 4},
    },
    "required": ["label", "count", "sizes"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,6}@(mail|post)\.(com|org)"
CHOICES = ["positive", "negative", "neutral"]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return write_model("tiny-llama", tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return Engine(tiny_llama, EngineConfig(max_pages=256, max_seqs=16, max_seq_len=512))


def _prompts(count: int, seed: int) -> list[list[int]]:
    """`count` prompts of 1 to 40 tokens, ids in [6, 300)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(6, 300, int(n)).tolist() for n in rng.integers(1, 41, count)]


def _requests(sampling: SamplingConfig, count: int = 12, prefix: str = "q") -> list[Request]:
    return [Request(f"{prefix}{i}", tuple(p), sampling) for i, p in enumerate(_prompts(count, seed=2))]


def _check_all(records, valid, bounded: bool = True) -> None:
    """Every record that stopped is valid; a format of bounded length always stops (an unbounded one may reach
    max_new_tokens: `length`, never checked as valid), and most of its records stop."""
    assert all(r.error is None for r in records), [r.error for r in records]
    stopped = [r for r in records if r.finish_reason == "stop"]
    assert all(r.finish_reason in ("stop", "length") for r in records)
    if bounded:
        assert len(stopped) == len(records), [(r.finish_reason, r.completion) for r in records]
    assert 2 * len(stopped) > len(records)
    for r in stopped:
        assert valid(r.completion), r.completion


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_completions_validate(engine, temperature):
    sampling = SamplingConfig(max_new_tokens=80, temperature=temperature, seed=4, json_schema=SCHEMA)

    def valid(text: str) -> bool:
        jsonschema.validate(json.loads(text), SCHEMA)
        return True

    records = engine.generate(_requests(sampling))
    _check_all(records, valid)
    if temperature > 0:
        assert len({r.completion for r in records}) > 1  # sampled: not every row the same object


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_regex_and_choice_completions_match(engine, temperature):
    regex = SamplingConfig(max_new_tokens=40, temperature=temperature, seed=1, regex=REGEX)
    _check_all(engine.generate(_requests(regex)), lambda text: re.fullmatch(REGEX, text) is not None)
    choice = SamplingConfig(max_new_tokens=40, temperature=temperature, seed=1, choice=CHOICES)
    _check_all(engine.generate(_requests(choice)), lambda text: text in CHOICES)


def test_lark_grammar_and_json_text_schema(engine):
    grammar = 'start: "(" num ("+" num)* ")"\nnum: /[0-9]{1,3}/'
    sampling = SamplingConfig(max_new_tokens=40, temperature=1.0, grammar=grammar)
    _check_all(engine.generate(_requests(sampling)), lambda t: re.fullmatch(r"\(\d{1,3}(\+\d{1,3})*\)", t) is not None,
               bounded=False)
    text = SamplingConfig(max_new_tokens=80, json_schema=json.dumps(SCHEMA))  # as the command line gives it
    as_mapping = SamplingConfig(max_new_tokens=80, json_schema=SCHEMA)
    assert [r.token_ids for r in engine.generate(_requests(text))] == \
        [r.token_ids for r in engine.generate(_requests(as_mapping))]


def test_rows_with_different_schemas_share_a_batch(engine):
    other = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
             "additionalProperties": False}
    mixed = []
    for i, prompt in enumerate(_prompts(12, seed=3)):
        schema = SCHEMA if i % 3 == 0 else other if i % 3 == 1 else None
        mixed.append(Request(f"m{i}", tuple(prompt), SamplingConfig(max_new_tokens=60, json_schema=schema)))
    for request, record in zip(mixed, engine.generate(mixed)):
        schema = request.sampling.json_schema
        if schema is not None:
            assert record.finish_reason == "stop"
            jsonschema.validate(json.loads(record.completion), schema)


def test_reaching_max_new_tokens_first_is_length(engine):
    sampling = SamplingConfig(max_new_tokens=3, json_schema=SCHEMA)
    for r in engine.generate(_requests(sampling, count=4)):
        assert r.finish_reason == "length" and len(r.token_ids) == 3


def test_a_permissive_grammar_leaves_greedy_tokens_alone(engine):
    """Wherever the model's own greedy choice is allowed, the constrained greedy token is that choice: any text
    (`(?s:.*)`) allows every token of valid UTF-8, so the tokens agree up to the first one the tiny random model
    picks that would break UTF-8 (a lone continuation byte), and differ there. The logprobs are the constrained
    distribution's: at least the unconstrained ones where the tokens agree."""
    regex = r"(?s:.*)"
    plain = SamplingConfig(max_new_tokens=24, logprobs=True)
    free = SamplingConfig(max_new_tokens=24, logprobs=True, regex=regex)
    a = engine.generate(_requests(plain, count=24))
    b = engine.generate(_requests(free, count=24))
    agreed = 0
    for x, y in zip(a, b):
        k = engine.grammars.constraint(("regex", regex)).matcher.validate_tokens(x.token_ids)
        assert y.token_ids[:k] == x.token_ids[:k]
        if k < len(x.token_ids):
            assert y.token_ids[k] != x.token_ids[k]
        else:
            assert y.token_ids == x.token_ids and y.finish_reason == x.finish_reason
        assert all(lb >= la - 1e-6 for la, lb in zip(x.logprobs[:k], y.logprobs[:k]))
        agreed += k
    assert agreed >= 24 * 3, agreed  # the check above ran over many tokens, not a vacuous prefix


def test_constrained_rows_do_not_depend_on_their_batch(tiny_llama):
    """Tokens and logprobs (the same bits, on the CPU: docs/records.md) of constrained rows alone, shuffled among
    unconstrained ones, with prompts in several chunks, two samples of a prompt forked off one prefill, and under
    a pool small enough to preempt (recompute, then swap)."""
    prompts = varied_prompts(256, count=15, seed=7)  # 1 to 400 tokens: prompts in several chunks
    requests = []
    for i, p in enumerate(prompts):
        kind = i % 3
        sampling = SamplingConfig(max_new_tokens=30, temperature=0.9, seed=5, logprobs=True,
                                  json_schema=SCHEMA if kind == 0 else None, regex=REGEX if kind == 1 else None)
        for g in range(2 if i < 6 else 1):
            requests.append(Request(f"r{i}", tuple(p), sampling, generation_index=g))
    alone = Engine(tiny_llama, EngineConfig(max_pages=64, max_seq_len=512))
    reference = {(r.prompt_id, r.generation_index): alone.generate([r])[0] for r in requests[:12]}
    small = dict(max_pages=48, max_seqs=12, max_seqs_in_prefill=3, max_prefill_size=64, max_seq_len=512)
    configs = (EngineConfig(max_pages=256, max_seqs=16, max_seq_len=512), EngineConfig(**small),
               EngineConfig(**small, preemption="swap", host_kv_pages=256))
    for config in configs:
        shuffled = list(requests)
        np.random.default_rng(3).shuffle(shuffled)
        engine = Engine(tiny_llama, config)
        got = {(r.prompt_id, r.generation_index): r for r in engine.generate(shuffled)}
        for key, ref in reference.items():
            assert (got[key].token_ids, got[key].logprobs, got[key].finish_reason) == \
                (ref.token_ids, ref.logprobs, ref.finish_reason), f"{key} under {config}"
        if config.max_pages == 48:
            assert engine.scheduler.num_preemptions > 0  # the small pool preempted
    assert engine.snapshot()["num_swaps"] > 0  # and the last engine swapped


def test_a_grammar_that_does_not_compile_is_the_request_error(engine):
    bad = [Request("schema", (5, 6), SamplingConfig(json_schema={"type": "nonsense"})),
           Request("empty", (5, 6), SamplingConfig(json_schema={"type": "integer", "minimum": 5, "maximum": 1})),
           Request("regex", (5, 6), SamplingConfig(regex="a(")),
           Request("ok", (5, 6), SamplingConfig(max_new_tokens=8, choice=["yes", "no"]))]
    by_id = {r.prompt_id: r for r in engine.generate(bad)}
    assert by_id["schema"].error.startswith("invalid_grammar: sampling.json_schema: ")
    assert "nonsense" in by_id["schema"].error and "\n" not in by_id["schema"].error
    assert "minimum" in by_id["empty"].error  # no string satisfies it: llguidance says why
    assert by_id["regex"].error.startswith("invalid_grammar: sampling.regex: ")
    assert by_id["ok"].error is None and by_id["ok"].completion in ("yes", "no")


def test_one_structured_output_at_most():
    with pytest.raises(ValueError, match="sampling.json_schema and sampling.regex are both set"):
        SamplingConfig(json_schema={"type": "object"}, regex="a+")
    with pytest.raises(ValueError, match="sampling.json_schema is not JSON"):
        SamplingConfig(json_schema="{not json")
    with pytest.raises(ValueError, match="sampling.choice must be a non-empty list of strings"):
        SamplingConfig(choice=[])


def test_a_tokenizer_larger_than_the_model_vocabulary_is_each_constraints_error(tiny_llama):
    """llguidance refuses a tokenizer with more tokens than the model has ids: that was an exception out of the
    planner (a whole plan lost to one row's response_format); now every constraint reports it, one line."""
    from transformers import AutoTokenizer

    from engine.sampling.structured import compiler_for, structured_error

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    why = structured_error(tokenizer, len(tokenizer) - 10, SamplingConfig(regex="[a-z]+"))
    assert why.startswith("sampling.regex: the tokenizer does not fit the model's vocabulary of ")
    assert "vocab size too small" in why and "\n" not in why
    with pytest.raises(ValueError, match="invalid_grammar: sampling.choice: the tokenizer does not fit"):
        compiler_for(tokenizer, len(tokenizer) - 10).constraint(("choice", '["a", "b"]'))
    assert structured_error(tokenizer, len(tokenizer), SamplingConfig(regex="[a-z]+")) is None


def test_every_id_that_ends_the_sequence_may_end_an_open_format_where_eos_may(engine, tiny_llama):
    """Where the format may end, each of the sequence's stop ids (the model's EOS ids, its stop_token_ids) is allowed
    as the tokenizer's EOS is, as vLLM's default backend (xgrammar) allows them: an instruct model whose end of turn is
    not the tokenizer's EOS (Gemma's `<end_of_turn>`, named in generation_config.json) may end an open-ended regex
    or choice with it instead of being held to a token it never predicts. Where the format may not end, none is."""
    from transformers import AutoTokenizer

    from engine.sampling.structured import Constraint, mask_words

    grammars = engine.grammars
    eos, end = grammars.tokenizer.eos_token, AutoTokenizer.from_pretrained(tiny_llama).convert_tokens_to_ids("<|end|>")
    assert end != eos

    def allowed(constraint: Constraint) -> set[int]:
        mask = np.zeros((2, mask_words(grammars.vocab_size)), np.int32)
        Constraint.fill_masks([None, constraint], mask)
        assert not mask[0].any()  # a row without a format is left as it is
        bits = np.unpackbits(mask[1:].view(np.uint8), bitorder="little")
        return set(np.flatnonzero(bits).tolist()) & {eos, end}

    ending = grammars.constraint(("regex", "ab+"), {eos, end, grammars.vocab_size + 5})  # an id past the vocabulary
    held = grammars.constraint(("regex", "ab+"))
    assert allowed(ending) == allowed(held) == set()  # "" cannot end
    for token in grammars.tokenizer.tokenize_str("ab"):
        assert not ending.advance(token) and not held.advance(token)
    assert allowed(ending) == {eos, end} and allowed(held) == {eos}  # "ab" may end, or go on
    # Through the engine: hot samples (nearly every allowed token likely) of the same format, `<|end|>` a stop id
    records = engine.generate(_requests(SamplingConfig(max_new_tokens=16, temperature=4.0, regex="ab+",
                                                       stop_token_ids=[end]), count=16, prefix="end"))
    ends = [r for r in records if r.token_ids[-1] == end]
    assert ends and all(r.finish_reason == "stop" and re.fullmatch("ab+", r.completion) for r in ends)
