"""Structured outputs: a sample's grammar (`sampling.json_schema`, `regex`, `choice` or `grammar`), compiled by
llguidance once per process, and each constrained sequence's matcher, which says which tokens may come next.

The host side only: `Constraint.fill_masks` writes the allowed tokens of the constrained rows of a step as a
bitmask (`i32[rows, ceil(vocab / 32)]`, bit `t % 32` of word `t // 32` set when token t is allowed), which the
device applies to the logits before sampling (engine/device/device_calls.py's `pick`). llguidance is the
library (docs/structured-outputs.md says why): it reads a Hugging Face tokenizer.json, writes numpy bitmasks
for many rows at once on a thread pool of its own, and needs no torch.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence

import llguidance
import llguidance.numpy as llg_numpy
import numpy as np

from engine.sampling.structured_spec import Spec


JSON_DEFAULTS = {"whitespace_flexible": False}
"""JSON as `json.dumps(separators=(",", ":"))` writes it: no whitespace between tokens, so a completion's length is
its content's (a model is never free to pad with whitespace until max_new_tokens). A schema's own `x-guidance`
options (llguidance's) override it."""


def grammar_text(spec: Spec) -> str:
    """llguidance's grammar for the constraint (not yet checked: `Compiler.error` checks it)."""
    kind, text = spec
    if kind == "json_schema":
        return llguidance.LLMatcher.grammar_from_json_schema(text, defaults=JSON_DEFAULTS)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(text)
    if kind == "choice":  # each choice a literal, as llguidance's own grammar_from("choice") builds it
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in json.loads(text)))
    return llguidance.LLMatcher.grammar_from_lark(text)


def one_line(message: str) -> str:
    """llguidance's message (several lines with a caret under the fault) as one line."""
    return " ".join(part.strip() for part in message.splitlines() if part.strip())


class Compiler:
    """The compiled grammars of one tokenizer: each distinct constraint is compiled once (a matcher kept as
    a template) and each sequence gets a copy (`Constraint.of`). Compiling is llguidance's lexer and grammar
    construction; a copy shares them."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_id: int | None) -> None:
        """`tokenizer_json`: the tokenizer as Hugging Face tokenizers serialise it (tokenizer.json's text);
        `vocab_size`: the model's (the mask's width; ids past the tokenizer's are never allowed)."""
        self.vocab_size = vocab_size
        self._templates: dict[Spec, llguidance.LLMatcher | str] = {}  # a matcher, or why the grammar fails
        self.unusable: str | None = None
        """Why no grammar can be used with this tokenizer and vocabulary (then every constraint fails with it)."""
        try:
            self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos_token_id)
        except ValueError as err:  # e.g. a tokenizer with more tokens than the model has ids
            self.unusable = (f"the tokenizer does not fit the model's vocabulary of {vocab_size} ids "
                             f"({one_line(str(err))}); structured outputs need the model's own tokenizer")

    def _template(self, spec: Spec) -> llguidance.LLMatcher | str:
        if self.unusable is not None:
            return self.unusable
        if spec not in self._templates:
            try:
                grammar = grammar_text(spec)
            except ValueError as err:
                self._templates[spec] = one_line(str(err))
            else:
                matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
                self._templates[spec] = one_line(matcher.get_error()) if matcher.is_error() else matcher
        return self._templates[spec]

    def error(self, spec: Spec) -> str | None:
        """Why the constraint cannot be used (llguidance's reason, one line), or None."""
        template = self._template(spec)
        return template if isinstance(template, str) else None

    def constraint(self, spec: Spec, stop_ids: Iterable[int] = ()) -> "Constraint":
        """A sequence's copy of the grammar; `stop_ids`: every id that ends the sequence (the model's EOS ids, its
        own stop_token_ids), each allowed wherever the grammar allows the tokenizer's EOS, as vLLM's default
        backend (xgrammar) allows them: an instruct model's end of turn (Gemma's `<end_of_turn>`) that is not the
        tokenizer's EOS may end an open-ended format."""
        template = self._template(spec)
        if isinstance(template, str):
            raise ValueError(f"invalid_grammar: sampling.{spec[0]}: {template}")
        eos = self.tokenizer.eos_token
        ends = () if eos is None else tuple(sorted({t for t in stop_ids if 0 <= t < self.vocab_size} - {eos}))
        return Constraint(template.deep_copy(), eos, ends)


_COMPILERS: dict[tuple[str, int, int | None], Compiler] = {}


def compiler_for(tokenizer, vocab_size: int) -> Compiler:
    """The process's one Compiler for a tokenizer (a transformers fast tokenizer or a `tokenizers.Tokenizer`) and
    vocabulary size."""
    text = getattr(tokenizer, "backend_tokenizer", tokenizer).to_str()
    eos = getattr(tokenizer, "eos_token_id", None)
    key = (hashlib.blake2b(text.encode("utf-8"), digest_size=16).hexdigest(), vocab_size, eos)
    if key not in _COMPILERS:
        _COMPILERS[key] = Compiler(text, vocab_size, eos)
    return _COMPILERS[key]


def structured_error(tokenizer, vocab_size: int, sampling) -> str | None:
    """Why the structured output `sampling` (a SamplingConfig) sets cannot be compiled for this tokenizer and
    vocabulary (`sampling.KEY: llguidance's reason`, one line), or None (also when it sets none)."""
    spec = sampling.structured
    if spec is None:
        return None
    why = compiler_for(tokenizer, vocab_size).error(spec)
    return None if why is None else f"sampling.{spec[0]}: {why}"


_EXECUTOR: list[llguidance.LLExecutor] = []  # one thread pool per process, made on first use


class Constraint:
    """One sequence's grammar state: the tokens it has generated, consumed in order (`advance`). Host state of
    its Sequence: recomputing or swapping the sequence's KV never touches it."""

    def __init__(self, matcher: llguidance.LLMatcher, eos: int | None = None, ends: tuple[int, ...] = ()) -> None:
        self.matcher = matcher
        self.eos = eos
        """The tokenizer's EOS, which the grammar allows where the format may end."""
        self.ends = ends
        """The sequence's other stop ids, allowed where `eos` is."""

    def advance(self, token_id: int) -> bool:
        """Consume a generated token; True when the grammar is complete and nothing more may follow."""
        if not self.matcher.consume_token(token_id):
            raise RuntimeError(f"the grammar refused token {token_id}, which its mask allowed: "
                               f"{one_line(self.matcher.get_error())}")
        return self.matcher.is_stopped()

    @staticmethod
    def fill_masks(constraints: Sequence["Constraint | None"], mask: np.ndarray) -> None:
        """Write row r's allowed tokens into `mask[r]` (i32[rows, words]) for each row with a constraint, on
        llguidance's thread pool; the other rows are left as they are."""
        rows = [(c.matcher, r) for r, c in enumerate(constraints) if c is not None]
        if not _EXECUTOR:
            _EXECUTOR.append(llguidance.LLExecutor())
        llg_numpy.fill_next_token_bitmask_par(_EXECUTOR[0], rows, mask)
        words = mask.view(np.uint32)
        for r, c in enumerate(constraints):
            if c is not None and c.ends and words[r, c.eos >> 5] >> np.uint32(c.eos & 31) & 1:
                for t in c.ends:
                    words[r, t >> 5] |= np.uint32(1 << (t & 31))


def mask_words(vocab_size: int) -> int:
    """32-bit words of one row's bitmask."""
    return (vocab_size + 31) // 32
