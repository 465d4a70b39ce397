"""Packing accepted prompts into batches: pure functions on token counts, no I/O.

A *batch* is the unit of work handed to one slice: the engine admits all of its sequences
together, so a batch must fit the engine at once, with no preemption, in the worst case where
every sample runs to `max_new_tokens`. Four budgets bound a batch:

- **pages** (`packing.page_budget`, default `engine.max_pages`): the KV pages all its sequences
  hold at full length. A prompt of `L` tokens with `n` samples and `M` new tokens needs
  `floor(L / page_size) + n * (ceil((L + M) / page_size) - floor(L / page_size))` pages: the
  `n` samples share the prompt's full pages and each owns the rest (`page_need`). A model's sliding-window
  layers (engine.kv_groups) hold at most their window's pages: a prompt needs fewer pages' worth then.
- **sequences** (`engine.max_seqs`): samples decoded at once, `n` per prompt.

A scored row (docs/records.md) is packed as a context of `L` tokens with one sequence per continuation (`k`
of them, `sampling.n` being 1): it counts `k` sequences and `k` prompts in prefill, its prefill tokens are the
context, every continuation and what the prefix cache does not serve the later ones, and its pages are the
context's shared full pages plus, per continuation, the rest at its longest continuation and one drawn token
(engine.pages_needed and scored_prefill_tokens with `scored`). Where the cache serves them nothing
(engine.prefix_caching off, or sampling.prompt_logprobs) each continuation counts its whole context.
- **prefill tokens** (`packing.prefill_budget`, default `engine.max_prefill_size`, in tokens per
  engine step): the batch's prompts must be prefilled within `packing.max_prefill_steps` steps, so
  its prompt tokens (counted once per prompt; samples share the prefill) are at most
  `prefill_budget * max_prefill_steps`. This bounds a batch's time to first token instead of
  forcing a whole batch into one step (which would make batches of a handful of prompts).
- **prompts in prefill** (`engine.max_seqs_in_prefill` prompts per step): likewise at most
  `max_seqs_in_prefill * max_prefill_steps` prompts per batch.

Greedy, longest first: prompts are sorted by token count (descending, ties by corpus order), except that
prompts sharing their leading page (the same first `page_size` tokens; `leading_page_keys`) sort together,
at the place of the group's longest prompt, longest first within the group: the prefix cache of the slice
that runs them then sees them close together in time. With no shared leading page the order is the plain
length order. Sharing earns a batch no credit: its pages are counted as if nothing were shared.
Each new batch starts with the longest remaining prompt and then takes, one at a time, either the
next longest or the shortest remaining prompt, whichever keeps the batch's use of the "size"
budgets (pages, prompt tokens) and of the "count" budgets (sequences, prompts) in the same
proportion as the remaining work; a batch closes when neither fits. Mixing long and short
prompts this way fills every budget that binds globally, so the number of batches stays close to
the lower bound (`lower_bound`). The result depends only on the token counts and the limits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from engine import EngineConfig, KVGroups, SamplingConfig, pages_needed, scored_context_shared, scored_prefill_tokens


@dataclass(frozen=True)
class PackingConfig:
    page_budget: int | None = None
    """KV pages one batch may hold at once; defaults to engine.max_pages."""
    prefill_budget: int | None = None
    """Prompt tokens prefilled per engine step; defaults to engine.max_prefill_size."""
    max_prefill_steps: int = 16
    """Engine steps within which a batch's prompts must be prefilled (bounds prompt tokens and
    prompts per batch together with prefill_budget and engine.max_seqs_in_prefill)."""

    def __post_init__(self) -> None:
        for name in ("page_budget", "prefill_budget", "max_prefill_steps"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"packing.{name} must be at least 1, got {value}")


@dataclass(frozen=True)
class PackingLimits:
    """The resolved per-batch budgets and the per-prompt quantities they are measured in."""

    page_size: int
    """Tokens per KV page."""
    max_new_tokens: int
    """Most tokens generated per sample."""
    n: int
    """Samples per prompt."""
    max_pages: int
    """KV pages per batch."""
    max_prompt_tokens: int
    """Prompt tokens per batch (prefill budget times prefill steps)."""
    max_seqs: int
    """Samples per batch."""
    max_prompts: int
    """Prompts per batch (max_seqs_in_prefill times prefill steps, and max_seqs // n)."""
    context_shared: bool = True
    """Whether a scored row's continuations share its context's pages (engine.scored_context_shared)."""
    groups: KVGroups | None = None
    """The engine's KV layer groups (engine.KVGroups): a sliding-window layer holds its window's pages only."""
    step_tokens: int = 0
    """The most tokens one engine step computes or reserves for a sequence (a sliding layer's window spans them)."""

    @classmethod
    def resolve(cls, packing: PackingConfig, engine: EngineConfig, sampling: SamplingConfig,
                groups: KVGroups | None = None) -> PackingLimits:
        """`groups`: the model's KV layer groups as the engine runs them (model_source.kv_groups); None: one table."""
        if sampling.n > engine.max_seqs:
            raise ValueError(
                f"sampling.n ({sampling.n}) exceeds engine.max_seqs ({engine.max_seqs}): one prompt's samples "
                "must decode together; raise engine.max_seqs or lower sampling.n"
            )
        prefill = packing.prefill_budget or engine.max_prefill_size
        return cls(
            page_size=engine.page_size,
            max_new_tokens=sampling.max_new_tokens,
            n=sampling.n,
            max_pages=packing.page_budget or engine.max_pages,
            max_prompt_tokens=prefill * packing.max_prefill_steps,
            max_seqs=engine.max_seqs,
            max_prompts=min(engine.max_seqs_in_prefill * packing.max_prefill_steps, engine.max_seqs // sampling.n),
            context_shared=scored_context_shared(engine, sampling),
            groups=groups,
            step_tokens=max(engine.max_prefill_size, 2 * engine.decode_steps),
        )

    def page_need(self, num_tokens: np.ndarray | int, max_new_tokens: np.ndarray | int | None = None,
                  continuations: np.ndarray | int | None = None) -> np.ndarray | int:
        """Exact KV pages for one prompt of `num_tokens` tokens and its `n` samples at full length; each prompt's
        own `max_new_tokens` (a row's `sampling` override, or a scored row's `continuation.new_tokens`) where
        given, else the run's. `continuations`: a scored row's count of them (0 for a sampled row)."""
        new = self.max_new_tokens if max_new_tokens is None else max_new_tokens
        if continuations is None:
            return pages_needed(num_tokens, new, self.page_size, self.n, groups=self.groups,
                                step_tokens=self.step_tokens)
        scored = np.asarray(continuations) > 0
        return pages_needed(num_tokens, new, self.page_size, np.where(scored, continuations, self.n),
                            scored.astype(np.int64), self.context_shared, self.groups, self.step_tokens)

    def scored_prefill(self, context: list[int], continuations: list[list[int]]) -> int:
        """The prompt tokens a scored row's prefill computes (engine.scored_prefill_tokens)."""
        return scored_prefill_tokens(len(context), list(map(len, continuations)), self.page_size, self.context_shared)

    def units(self, continuations: np.ndarray | int | None) -> np.ndarray | int:
        """Prompts an item counts as in the count budgets: 1, or a scored row's continuations (each its own
        sequence and its own prefill; `n` is then 1)."""
        return 1 if continuations is None else np.maximum(continuations, 1)

    def why_unfit(self, num_tokens: int, max_new_tokens: int | None = None, continuations: int = 0,
                  prefill_tokens: int | None = None) -> str | None:
        """Why a single prompt (a scored row: with its `continuations` and `prefill_tokens`) can never fit a
        batch, or None when it can."""
        new = self.max_new_tokens if max_new_tokens is None else max_new_tokens
        pages = int(self.page_need(num_tokens, new, continuations))
        prefill = num_tokens if prefill_tokens is None else prefill_tokens
        if pages > self.max_pages:
            what = (f"{continuations} continuation(s) of up to {new - 1} tokens" if continuations else
                    f"{self.n} sample(s) of {new} new tokens")
            return (f"needs {pages} KV pages with {what}; a batch "
                    f"holds {self.max_pages} (packing.page_budget / engine.max_pages)")
        if prefill > self.max_prompt_tokens:
            return (f"has {prefill} prompt tokens; a batch prefills at most {self.max_prompt_tokens} "
                    "(packing.prefill_budget * packing.max_prefill_steps)")
        if continuations > min(self.max_seqs // self.n, self.max_prompts):
            return (f"has {continuations} continuations, each its own sequence; a batch runs at most "
                    f"{min(self.max_seqs // self.n, self.max_prompts)} (engine.max_seqs, and "
                    "engine.max_seqs_in_prefill * packing.max_prefill_steps)")
        return None


@dataclass(frozen=True)
class Packing:
    """Batches as slices of `order`: batch b holds items `order[offsets[b]:offsets[b + 1]]`."""

    order: np.ndarray  # i64[items]: item indices (positions in the input), batch by batch, longest first
    offsets: np.ndarray  # i64[batches + 1]
    num_pages: np.ndarray  # i64[batches]
    num_prompt_tokens: np.ndarray  # i64[batches]

    @property
    def num_batches(self) -> int:
        return len(self.offsets) - 1

    def batch(self, b: int) -> np.ndarray:
        return self.order[self.offsets[b]:self.offsets[b + 1]]

    def batch_of_item(self) -> np.ndarray:
        """i32[items]: the batch index of every item."""
        out = np.empty(len(self.order), dtype=np.int32)
        out[self.order] = np.repeat(np.arange(self.num_batches, dtype=np.int32), np.diff(self.offsets))
        return out


_KEY_BASE = np.uint64(0x100000001B3)  # odd, hence invertible modulo 2**64
_KEY_BASE_INV = np.uint64(pow(0x100000001B3, -1, 2**64))


def leading_page_keys(token_ids: np.ndarray, page_size: int) -> np.ndarray:
    """u64[pages]: one key per full page of the prompt before its last token (that token is always computed:
    its logits draw the first sample), each identifying the whole prefix up to the page's end (a polynomial
    hash of the prefix modulo 2**64, so equal prefixes give equal keys; a rare collision only misplaces a
    prompt in the plan's order or miscounts the report, never changes a sample). Never 0 (0 means "none")."""
    tokens = np.asarray(token_ids, dtype=np.uint64)
    return leading_page_keys_of_many(tokens, np.array([0, len(tokens)], dtype=np.int64), page_size)[0]


def leading_page_keys_of_many(tokens: np.ndarray, offsets: np.ndarray, page_size: int) -> tuple[np.ndarray, np.ndarray]:
    """`leading_page_keys` of many prompts at once, prompt i being tokens[offsets[i]:offsets[i + 1]]: (u64[keys]
    all their keys, prompt after prompt; i64[prompts + 1] where each prompt's keys start). Numpy over runs of
    consecutive prompts of about _RUN_TOKENS tokens (a shard's prompts in a few passes), the same keys as one prompt at
    a time: modulo 2**64 the hash is exact, wherever a run starts."""
    tokens = np.asarray(tokens)
    offsets = np.asarray(offsets, dtype=np.int64)
    pages = np.maximum(np.diff(offsets) - 1, 0) // page_size
    key_offsets = np.concatenate([[0], np.cumsum(pages)]).astype(np.int64)
    keys = np.empty(key_offsets[-1], dtype=np.uint64)
    first = 0
    while first < len(pages) and key_offsets[-1]:
        end = max(first + 1, int(np.searchsorted(offsets, offsets[first] + _RUN_TOKENS, side="right")) - 1)
        end = min(end, len(pages))
        keys[key_offsets[first]:key_offsets[end]] = _run_keys(tokens[offsets[first]:offsets[end]],
                                                              offsets[first:end + 1] - offsets[first],
                                                              pages[first:end], page_size)
        first = end
    keys[keys == 0] = 1
    return keys, key_offsets


_RUN_TOKENS = 1 << 18
"""Tokens hashed in one numpy pass, about: a run's arrays stay in the CPU's caches, and the powers of the key's base
(_powers) stay small."""
_POWERS = [np.ones(1, dtype=np.uint64), np.ones(1, dtype=np.uint64)]


def _powers(count: int) -> tuple[np.ndarray, np.ndarray]:
    """(B**p, B**-p for p < count) modulo 2**64, B being _KEY_BASE: computed once, kept for the next runs."""
    if len(_POWERS[0]) < count:
        size = max(count, 2 * len(_POWERS[0]))
        with np.errstate(over="ignore"):
            _POWERS[:] = [np.cumprod(np.concatenate([[np.uint64(1)], np.full(size - 1, base, dtype=np.uint64)]))
                          for base in (_KEY_BASE, _KEY_BASE_INV)]
    return _POWERS[0][:count], _POWERS[1][:count]


def _run_keys(tokens: np.ndarray, offsets: np.ndarray, pages: np.ndarray, page_size: int) -> np.ndarray:
    """The keys of a run of prompts (tokens[offsets[i]:offsets[i + 1]], `pages[i]` keys each), positions counted from
    the run's start."""
    fwd, inv = _powers(len(tokens))
    starts = offsets[:-1]
    with np.errstate(over="ignore"):
        # A prompt's prefix of k tokens from position s: sum_{j<k} (t_{s+j} + 1) * B^(k-1-j)
        # = B^(s+k-1) * (C[s+k] - C[s]), where C[i] = sum_{p<i} (t_p + 1) * B^-p: all modulo 2**64 (B is odd).
        cumulative = np.zeros(len(tokens) + 1, dtype=np.uint64)
        np.cumsum((tokens.astype(np.uint64) + np.uint64(1)) * inv, out=cumulative[1:])
        prompt = np.repeat(np.arange(len(pages)), pages)
        page = np.arange(len(prompt)) - (np.cumsum(pages) - pages)[prompt] + 1  # 1.. within its prompt
        ends = starts[prompt] + page * page_size
        return fwd[ends - 1] * (cumulative[ends] - cumulative[starts[prompt]])


def shareable_prompt_tokens(page_keys: list[np.ndarray] | np.ndarray, page_size: int) -> int:
    """Prompt tokens in leading full pages that an earlier prompt also has (in any order, the count is the
    same): `page_size` times (pages - distinct pages) over all prompts' leading page keys."""
    flat = np.concatenate(page_keys) if isinstance(page_keys, list) and page_keys else np.asarray(page_keys)
    flat = np.sort(flat.astype(np.uint64, copy=False).ravel())  # one copy: a window's keys run to 100 MB and more
    return page_size * int(np.count_nonzero(flat[1:] == flat[:-1]))


def bound_totals(num_tokens: np.ndarray, limits: PackingLimits, max_new_tokens: np.ndarray | None = None,
                 continuations: np.ndarray | None = None, prefill_tokens: np.ndarray | None = None) -> np.ndarray:
    """What `lower_bound` divides by the limits: [KV pages, prefill tokens, sequence units, prompts] (int64[4]). The
    totals of several planning windows add up to their corpus's."""
    num_tokens = np.asarray(num_tokens, dtype=np.int64)
    if len(num_tokens) == 0:
        return np.zeros(4, np.int64)
    count = int(np.sum(limits.units(continuations))) if continuations is not None else len(num_tokens)
    prefill = num_tokens if prefill_tokens is None else np.asarray(prefill_tokens, dtype=np.int64)
    return np.array([int(limits.page_need(num_tokens, max_new_tokens, continuations).sum()), int(prefill.sum()),
                     count, len(num_tokens)], np.int64)


def lower_bound_of(totals: np.ndarray, limits: PackingLimits) -> int:
    """No packing can use fewer batches: the largest of the page, prefill and sequence-count bounds of `totals`
    (bound_totals)."""
    pages, prefill, count, prompts = (int(t) for t in totals)
    return max(
        math.ceil(pages / limits.max_pages),
        math.ceil(prefill / limits.max_prompt_tokens),
        math.ceil(count * limits.n / limits.max_seqs),
        math.ceil(prompts / limits.max_prompts),
    )


def lower_bound(num_tokens: np.ndarray, limits: PackingLimits, max_new_tokens: np.ndarray | None = None,
                continuations: np.ndarray | None = None, prefill_tokens: np.ndarray | None = None) -> int:
    """No packing can use fewer batches: the largest of the page, prefill and sequence-count bounds."""
    return lower_bound_of(bound_totals(num_tokens, limits, max_new_tokens, continuations, prefill_tokens), limits)


def sharing_order(tokens: np.ndarray, first_page_keys: np.ndarray | None) -> np.ndarray:
    """Item indices longest first (ties in corpus order), items with the same nonzero first-page key together
    at their group's place: sorted by (group's longest length, the corpus index of the group's first longest
    item, own length, corpus index). Items with key 0 or a key of their own are groups of one."""
    index = np.arange(len(tokens), dtype=np.int64)
    if first_page_keys is None or not len(tokens):
        return np.argsort(-tokens, kind="stable")
    keys = np.asarray(first_page_keys, dtype=np.uint64)
    distinct, group = np.unique(keys, return_inverse=True)
    keyed = int(np.count_nonzero(keys))
    if len(distinct) - (keyed < len(keys)) == keyed:  # no two items share a key: every item a group of its own
        return np.argsort(-tokens, kind="stable")
    group = np.where(keys == 0, len(tokens) + index, group.ravel())  # no key: a group of its own
    group_len = np.zeros(2 * len(tokens) + 1, dtype=np.int64)
    np.maximum.at(group_len, group, tokens)
    longest = tokens == group_len[group]
    leader = np.full(2 * len(tokens) + 1, len(tokens), dtype=np.int64)
    np.minimum.at(leader, group[longest], index[longest])
    return np.lexsort((index, -tokens, leader[group], -group_len[group]))


def pack(num_tokens: np.ndarray, limits: PackingLimits, first_page_keys: np.ndarray | None = None,
         max_new_tokens: np.ndarray | None = None, continuations: np.ndarray | None = None,
         prefill_tokens: np.ndarray | None = None) -> Packing:
    """Pack items (prompt token counts, in corpus order) into batches; every item must fit alone.
    `first_page_keys` (u64[items], 0 for none: `leading_page_keys(...)[0]`) keeps prompts that share their
    leading page together in the order (`sharing_order`). `max_new_tokens` (i64[items]) gives each item its own
    completion length (rows' `sampling` overrides; default the run's): its pages are counted with it.
    `continuations` (i64[items], 0 for a sampled row) and `prefill_tokens` (i64[items]) measure scored rows."""
    tokens = np.asarray(num_tokens, dtype=np.int64)
    order = sharing_order(tokens, first_page_keys)  # longest first (groups at their longest), ties in corpus order
    size_t = tokens[order]
    new_t = None if max_new_tokens is None else np.asarray(max_new_tokens, dtype=np.int64)[order]
    cont_t = None if continuations is None else np.asarray(continuations, dtype=np.int64)[order]
    fill_t = size_t if prefill_tokens is None else np.asarray(prefill_tokens, dtype=np.int64)[order]
    pages = np.asarray(limits.page_need(size_t, new_t, cont_t), dtype=np.int64)
    units = np.broadcast_to(np.asarray(limits.units(cont_t), dtype=np.int64), size_t.shape)
    cap_count = min(limits.max_seqs // limits.n, limits.max_prompts)  # prompts per batch allowed by the count budgets
    # Page need grows with length at one max_new_tokens: the longest item is the one to check; else every item.
    for i in (range(min(1, len(order))) if new_t is None and cont_t is None else
              np.flatnonzero((pages > limits.max_pages) | (fill_t > limits.max_prompt_tokens)
                             | (units > cap_count))[:1]):
        reason = limits.why_unfit(int(size_t[i]), None if new_t is None else int(new_t[i]),
                                  0 if cont_t is None else int(cont_t[i]), int(fill_t[i]))
        if reason is not None:
            raise ValueError(f"item {int(order[i])} cannot fit any batch: it {reason}")
    cum_pages = np.concatenate([[0], np.cumsum(pages)]).tolist()
    cum_tokens = np.concatenate([[0], np.cumsum(fill_t)]).tolist()
    cum_units = np.concatenate([[0], np.cumsum(units)]).tolist()
    pages_l, tokens_l, units_l = pages.tolist(), fill_t.tolist(), units.tolist()
    n, cap_p, cap_t, cap_s, cap_q = limits.n, limits.max_pages, limits.max_prompt_tokens, limits.max_seqs, limits.max_prompts

    chunks: list[tuple[int, int, int, int]] = []  # per batch: front [lo0, lo1), back [hi1, hi0)
    batch_pages: list[int] = []
    batch_tokens: list[int] = []
    lo, hi = 0, len(order)  # remaining items: sorted positions [lo, hi)
    while lo < hi:
        rem_p, rem_t, rem_c = cum_pages[hi] - cum_pages[lo], cum_tokens[hi] - cum_tokens[lo], cum_units[hi] - cum_units[lo]
        remaining_batches = max(1.0, rem_p / cap_p, rem_t / cap_t, rem_c * n / cap_s, rem_c / cap_q)
        # Targets: this batch's fair share of the remaining work in each budget.
        tgt_p, tgt_t, tgt_c = rem_p / remaining_batches, rem_t / remaining_batches, rem_c / remaining_batches
        start_lo, start_hi = lo, hi
        used_p = used_t = used_c = 0
        while lo < hi and used_c < cap_count:
            size_frac = max(used_p / tgt_p, used_t / tgt_t)
            count_frac = used_c / tgt_c
            sides = (lo, hi - 1) if size_frac <= count_frac else (hi - 1, lo)
            for i in sides:
                if used_p + pages_l[i] <= cap_p and used_t + tokens_l[i] <= cap_t and used_c + units_l[i] <= cap_count:
                    break
            else:
                break
            used_p += pages_l[i]
            used_t += tokens_l[i]
            used_c += units_l[i]
            if i == lo:
                lo += 1
            else:
                hi -= 1
        chunks.append((start_lo, lo, hi, start_hi))
        batch_pages.append(used_p)
        batch_tokens.append(used_t)

    pieces = []
    offsets = [0]
    for lo0, lo1, hi1, hi0 in chunks:
        pieces.append(order[lo0:lo1])
        pieces.append(order[hi1:hi0])
        offsets.append(offsets[-1] + (lo1 - lo0) + (hi0 - hi1))
    return Packing(
        order=np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64),
        offsets=np.asarray(offsets, dtype=np.int64),
        num_pages=np.asarray(batch_pages, dtype=np.int64),
        num_prompt_tokens=np.asarray(batch_tokens, dtype=np.int64),
    )
