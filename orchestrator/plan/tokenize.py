"""Tokenizing the corpus: reading a shard and turning its rows into token ids (on a Ray worker, or in the head).

Raw prompts (`corpus.text_field`) are encoded as the tokenizer does by default (its own special
tokens, e.g. BOS). Chats (`corpus.messages_field`) are rendered with the tokenizer's chat template
(`apply_chat_template(messages, tokenize=False, add_generation_prompt=True)`) and the rendered text
is encoded with `add_special_tokens=False`, since the template writes its own special tokens; a chat row
is rejected (`no_chat_template`) when the tokenizer has no template or its template refuses the row. A token
id the model has no embedding for (a tokenizer larger than the model's `vocab_size`) rejects its row
(`out_of_vocabulary`). Every row comes out, accepted or with a rejection reason; none is dropped.
"""

from __future__ import annotations

import gc
import itertools
from contextlib import contextmanager

import numpy as np
import pyarrow as pa

from engine import SamplingConfig, length_error
from engine import stop_ids_error, structured_error
from orchestrator.plan.chat import render_chat
from orchestrator.plan.corpus import (CorpusConfig, Prompt, RawRow, Shard, extract_prompt, in_window, passthrough,
                                      read_rows, row_id)
from orchestrator.plan.continuation import (continuations_error, encode_continuations, is_scored, new_tokens,
                                            row_continuations, scored_error, with_token_ids)
from orchestrator.plan.model_source import ModelSourceConfig, load_tokenizer
from orchestrator.plan.openai_batch import native_row, row_fields
from orchestrator.plan.packing import PackingLimits, leading_page_keys_of_many
from orchestrator.plan.prompt_checks import out_of_vocabulary
from orchestrator.plan.rejection import Rejection
from orchestrator.plan.response_format import with_response_format
from orchestrator.plan.row_sampling import apply, overrides_json, row_overrides

# Rejection reasons (rejected.jsonl `reason`).
REASONS = ("malformed_row", "undecodable", "missing_field", "wrong_type", "empty_prompt", "no_chat_template",
           "out_of_vocabulary", "too_long", "exceeds_budget", "duplicate_id", "reserved_column",
           "bad_sampling", "bad_continuation", "bad_response_format", "invalid_grammar", "unsupported_request")

SCHEMA = pa.schema([
    ("row", pa.int64()),  # row number in corpus order
    ("prompt_id", pa.string()),  # null when the row was rejected before an id was read
    ("num_tokens", pa.int32()),  # 0 when rejected before tokenizing
    ("token_ids", pa.list_(pa.int32())),
    ("reason", pa.string()),  # null when accepted
    ("detail", pa.string()),
    ("file_index", pa.int32()),  # the row's file, as a position in the sorted corpus file list
    ("line", pa.int64()),  # 1-based line of a JSON-lines file, else null
    ("page_keys", pa.list_(pa.uint64())),  # packing.leading_page_keys of an accepted prompt, else empty
    ("passthrough", pa.string()),  # corpus.passthrough of an accepted prompt (SampleRecord.passthrough), else null
    ("sampling", pa.string()),  # row_sampling.overrides_json of an accepted prompt's own settings, else null
    ("max_new_tokens", pa.int32()),  # the prompt's max_new_tokens (its own, else the run's; a scored row's
    # continuation.new_tokens)
    ("continuations", pa.list_(pa.list_(pa.int32()))),  # a scored row's continuations' token ids, else null
    ("num_continuations", pa.int32()),  # how many (0: a sampled row)
    ("prefill_tokens", pa.int32()),  # tokens its prefill computes (PackingLimits.scored_prefill), else num_tokens
])


def batch_encode(tokenizer, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
    """`tokenizer(texts)["input_ids"]`, straight from the Rust backend when there is one (same ids,
    without building Python encodings; tests check the two agree): its `encode_batch_fast`, which skips the
    character offsets nobody here reads (~17% faster than `encode_batch` on the plan bench's texts)."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if getattr(tokenizer, "is_fast", False) and backend is not None:
        return [e.ids for e in backend.encode_batch_fast(texts, add_special_tokens=add_special_tokens)]
    return tokenizer(texts, add_special_tokens=add_special_tokens)["input_ids"]


@contextmanager
def cycle_collector_paused():
    """Python's cycle collector off for the block (as it was after). A shard's rows are tens of thousands of
    dicts and lists alive at once, without cycles: the collector's passes over them found nothing and took ~15% of
    tokenizing a shard (its Rust encoding included); cycles made meanwhile are collected after."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class PromptTokenizer:
    """Tokenizes shards (`tokenize_shard`); built once per process that tokenizes (tokenized.tokenize_on_worker)."""

    def __init__(self, model: ModelSourceConfig, corpus: CorpusConfig, limits: PackingLimits, max_seq_len: int,
                 vocab_size: int | None = None, sampling: SamplingConfig | None = None):
        self.tokenizer = load_tokenizer(model)
        self.tokenizer_path = model.tokenizer_path
        self.limits, self.max_seq_len, self.vocab_size = limits, max_seq_len, vocab_size
        self.openai_batch = corpus.format == "openai_batch"  # lines become native rows (openai_batch.py)
        self.corpus = row_fields(corpus)
        self.sampling = sampling or SamplingConfig(max_new_tokens=limits.max_new_tokens, n=limits.n)
        self._by_length: dict[int, tuple[str, str] | None] = {}
        """`check` of a row without its own sampling settings or continuations, by its length (its ids aside)."""

    def render(self, prompt: Prompt) -> str | Rejection:
        """A chat as the tokenizer's chat template renders it, or why it cannot be."""
        return render_chat(self.tokenizer, prompt.messages, self.tokenizer_path, self.corpus.messages_field,
                           prompt.template_kwargs)

    def encode(self, prompts: list[Prompt]) -> list[list[int] | Rejection]:
        """Token ids of each prompt (text as is, chats through the chat template, ids as given), or why a chat cannot
        be rendered."""
        ids: list[list[int] | Rejection | None] = [p.token_ids for p in prompts]
        texts = [(i, p.text) for i, p in enumerate(prompts) if p.text is not None]
        chats = []
        for i, p in enumerate(prompts):
            if p.messages is not None:
                rendered = self.render(p)
                if isinstance(rendered, Rejection):
                    ids[i] = rendered
                else:
                    chats.append((i, rendered))
        for group, special in ((texts, True), (chats, False)):
            if group:
                for (i, _), tokens in zip(group, batch_encode(self.tokenizer, [t for _, t in group], special)):
                    ids[i] = tokens
        return ids  # type: ignore[return-value]

    def encode_scored(self, prompt: Prompt, continuations: list) -> tuple[list[int], list[list[int]]] | Rejection:
        """(context ids, continuations' ids) of a scored row (continuation.encode_continuations, a chat through
        its template; ids as given), or why its chat cannot be rendered or its text continuations cannot be split."""
        if prompt.token_ids is not None:
            return with_token_ids(prompt.token_ids, continuations)
        text, special = prompt.text, True
        if prompt.messages is not None:  # the template writes its own special tokens
            text, special = self.render(prompt), False
            if isinstance(text, Rejection):
                return text
        return encode_continuations(lambda t: batch_encode(self.tokenizer, [t], special)[0], text, continuations)

    def check(self, tokens: list[int], overrides: dict | None = None,
              continuations: list[list[int]] | None = None, in_vocabulary: bool = False) -> tuple[str, str] | None:
        """Why a tokenized prompt (a scored row's context, with its `continuations`) cannot run with its row's
        sampling `overrides` (row_sampling), or None. `in_vocabulary`: the caller has checked `tokens` lie in the
        model's vocabulary (a shard's ids at once: tokenize_shard)."""
        if not overrides and continuations is None:  # the common row: all but its ids depend on its length alone
            if not in_vocabulary and (why := out_of_vocabulary(tokens, self.vocab_size)) is not None:
                return "out_of_vocabulary", why
            if len(tokens) not in self._by_length:
                self._by_length[len(tokens)] = self._check(tokens, None, None)
            return self._by_length[len(tokens)]
        return self._check(tokens, overrides, continuations)

    def _check(self, tokens: list[int], overrides: dict | None,
               continuations: list[list[int]] | None) -> tuple[str, str] | None:
        sampling = apply(self.sampling, overrides)
        if continuations is not None and (why := scored_error(sampling) or continuations_error(tokens, continuations)):
            return tuple(why.split(": ", 1))  # type: ignore[return-value]
        new = (overrides or {}).get("max_new_tokens", self.limits.max_new_tokens)
        k, prefill = 0, None
        if continuations is not None:
            new, k = new_tokens(continuations), len(continuations)
            prefill = self.limits.scored_prefill(tokens, continuations)
        if (why := out_of_vocabulary(tokens + [t for c in continuations or () for t in c], self.vocab_size)) is not None:
            return "out_of_vocabulary", why
        if (problem := length_error(len(tokens), new, self.max_seq_len)) is not None:
            return problem
        if (why := self.limits.why_unfit(len(tokens), new, k, prefill)) is not None:
            return "exceeds_budget", f"prompt {why}"
        if (why := stop_ids_error(sampling.stop_token_ids, self.vocab_size)) is not None:
            return "out_of_vocabulary", why
        if (why := structured_error(self.tokenizer, self.vocab_size or len(self.tokenizer), sampling)) is not None:
            return "invalid_grammar", why
        return None

    def parse(self, raw: RawRow) -> tuple[Prompt | Rejection, list | Rejection | None, str | None, dict]:
        """A row as read: (its prompt, or why it cannot run; a scored row's continuations (row_continuations), None
        for a sampled row; its passthrough text; its own sampling overrides, `{}` for none)."""
        prompt = extract_prompt(raw, self.corpus)
        if not isinstance(prompt, Prompt):
            return prompt, None, None, {}
        record = raw.record
        continuations = row_continuations(record) if is_scored(record) else None
        if isinstance(continuations, Rejection):
            return continuations, continuations, None, {}
        kept = passthrough(record, self.corpus.id_field)
        if isinstance(kept, Rejection):
            return kept, continuations, kept, {}
        field, rf = self.corpus.sampling_field, self.corpus.response_format_field
        own = row_overrides(record.get(field), self.sampling, field) if field else {}
        if rf and isinstance(own, dict):
            own = with_response_format(own, record.get(rf), rf, self.sampling)
        if isinstance(own, Rejection):
            return own, continuations, kept, {}
        return prompt, continuations, kept, own

    def known_id(self, raw: RawRow) -> str | None:
        """A rejected row's own id where it has a valid one (so rejected.jsonl names it), else None."""
        if not isinstance(raw.record, dict):
            return None
        pid = row_id(raw.record, self.corpus.id_field, None)
        return pid if isinstance(pid, str) else None

    def tokenize_shard(self, shard: Shard) -> pa.Table:
        """The shard's rows (those of its window) as a SCHEMA table, in row order."""
        with cycle_collector_paused():
            return self._tokenize_shard(shard)

    def _tokenize_shard(self, shard: Shard) -> pa.Table:
        raw_rows = [r for r in read_rows(shard) if in_window(shard, r.row)]
        if self.openai_batch:
            raw_rows = [native_row(raw, self.sampling) for raw in raw_rows]
        parsed, scored, kept_columns, overrides = [], {}, [], []
        for i, raw in enumerate(raw_rows):  # one pass over the rows (not one per field)
            prompt, to_score, kept, own = self.parse(raw)
            parsed.append(prompt)
            kept_columns.append(kept)
            overrides.append(own)
            if to_score is not None:
                scored[i] = to_score
        ok = [i for i, p in enumerate(parsed) if isinstance(p, Prompt) and i not in scored]
        encoded = dict(zip(ok, self.encode([parsed[i] for i in ok])))
        continuations: dict[int, list[list[int]]] = {}
        for i in scored:
            if isinstance(parsed[i], Prompt):
                found = self.encode_scored(parsed[i], scored[i])
                encoded[i] = found if isinstance(found, Rejection) else found[0]
                if not isinstance(found, Rejection):
                    continuations[i] = found[1]
        # Every row's ids in one array, row after row: one vocabulary check for the shard (a row's own max and min
        # cost more than its share of the array), and the token_ids column when they all lie in the vocabulary (so
        # fit int32) and no tokenized row is rejected; else the column is made from the accepted rows as before.
        all_ids, in_vocabulary = None, False  # no vocabulary size known: nothing to check
        if self.vocab_size is not None:
            listed = [encoded[i] for i in range(len(parsed)) if isinstance(encoded.get(i), list)]
            all_ids = np.fromiter(itertools.chain.from_iterable(listed), dtype=np.int64, count=sum(map(len, listed)))
            in_vocabulary = not all_ids.size or (int(all_ids.min()) >= 0 and int(all_ids.max()) < self.vocab_size)
        prompt_ids, reasons, details, lengths, kept, kept_continuations = [], [], [], [], [], []
        dropped = 0  # tokenized rows rejected after
        for i, p in enumerate(parsed):
            tokens = encoded.get(i)
            prompt_ids.append(p.prompt_id if isinstance(p, Prompt) else self.known_id(raw_rows[i]))
            if isinstance(tokens, Rejection):  # a chat that cannot be rendered: its id is known
                p, tokens = tokens, None
            problem = ((p.reason, p.detail) if not isinstance(p, Prompt)
                       else self.check(tokens, overrides[i], continuations.get(i), in_vocabulary))
            reasons.append(problem[0] if problem else None)
            details.append(problem[1] if problem else None)
            lengths.append(len(tokens) if tokens is not None else 0)
            kept.append(tokens if tokens is not None and problem is None else ())
            dropped += tokens is not None and problem is not None
            kept_continuations.append(continuations.get(i) if problem is None else None)
        sizes = np.fromiter(map(len, kept), dtype=np.int64, count=len(kept))
        offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32)
        values = (all_ids.astype(np.int32) if in_vocabulary and not dropped else
                  np.fromiter(itertools.chain.from_iterable(kept), dtype=np.int32, count=int(sizes.sum())))
        keys, key_offsets = leading_page_keys_of_many(values, offsets, self.limits.page_size)
        return pa.Table.from_arrays([
            pa.array([r.row for r in raw_rows], pa.int64()),
            pa.array(prompt_ids, pa.string()),
            pa.array(lengths, pa.int32()),
            pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, pa.int32())),
            pa.array(reasons, pa.string()),
            pa.array(details, pa.string()),
            pa.array(np.full(len(raw_rows), shard.file_index, dtype=np.int32)),  # an index keeps summaries small
            pa.array([r.line for r in raw_rows], pa.int64()),
            pa.ListArray.from_arrays(pa.array(key_offsets.astype(np.int32)), pa.array(keys, pa.uint64())),
            pa.array([k if r is None else None for k, r in zip(kept_columns, reasons)], pa.string()),
            pa.array([overrides_json(o) if r is None else None for o, r in zip(overrides, reasons)], pa.string()),
            pa.array([o.get("max_new_tokens", self.limits.max_new_tokens) if c is None else new_tokens(c)
                      for o, c in zip(overrides, kept_continuations)], pa.int32()),
            pa.array(kept_continuations, pa.list_(pa.list_(pa.int32()))),
            pa.array([len(c or ()) for c in kept_continuations], pa.int32()),
            pa.array([len(t) if c is None else self.limits.scored_prefill(t, c)
                      for t, c in zip(kept, kept_continuations)],
                     pa.int32()),
        ], schema=SCHEMA)
