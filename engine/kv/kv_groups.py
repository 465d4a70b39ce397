"""Layer groups of the KV pool (`engine.kv_groups`): which layers share a page table, and which pages a group may
let go. No JAX here.

One page table for every layer makes a sliding-window layer hold KV for positions no query will look at again:
a Gemma 3 sequence of 32k tokens needs pages for every position in its global layers but only for the last
`sliding_window` positions in its sliding ones. As vLLM v1's hybrid KV cache manager does, the layers are put in
groups of `layers_per_unit` (k) layers of one attention kind, k the greatest common divisor of the kinds' layer
counts (Gemma 3 27B: 10 global and 52 sliding layers, k = 2, 31 groups; a model of one kind: one group of every
layer), and each group has its own page table. Every group's page is one *unit* of one allocator: k layers of
`page_size` tokens, so the pool is the same memory as before (units = max_pages x groups, each k layers deep)
and any group can use any unit. A sequence holds one page list per group; a sliding group gives a page back once
every position in it has left the window of the next token to compute (`first_needed`), and its entry becomes
NONE (the page table's 0: the attention kernels never read a block wholly before a query's window, and read a
block partly before it only to mask it).

The pool's layout follows: unit u of slot s (0 <= s < k) is pool row s x units + u; layer l reads its group's
page table at an offset of `layer_slot[l]` x units. With one group (k = layers, units = max_pages) this is the
layout of one table for every layer: layer l's copy of page p at l x max_pages + p.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

NONE = -1
"""A sequence's entry for a page it no longer holds (slid out of its group's window)."""


@dataclass(frozen=True)
class KVGroups:
    windows: tuple[int | None, ...]
    """Each group's window: tokens a query sees (its own included); None: the whole context."""
    layer_group: tuple[int, ...]
    """The group of each layer."""
    layer_slot: tuple[int, ...]
    """Each layer's place in its group's units (0 .. layers_per_unit - 1)."""

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def layers_per_unit(self) -> int:
        return len(self.layer_group) // self.num_groups

    def as_pages(self, units: int) -> int:
        """Pages of every layer that `units` units fill, rounded up (what engine.max_pages counts)."""
        return -(-units // self.num_groups)

    def units(self, max_pages: int) -> int:
        """Units in the pool of `max_pages` pages of every layer (the same memory)."""
        return max_pages * self.num_groups

    @classmethod
    def single(cls, num_layers: int, window: int | None = None) -> "KVGroups":
        """One page table for every layer; `window`: every layer's (its pages slide out of it)."""
        return cls((window,), (0,) * num_layers, tuple(range(num_layers)))

    @classmethod
    def of_layers(cls, groups: "KVGroups | None", num_layers: int) -> "KVGroups":
        """`groups` (a runner's config), or one page table for every layer; checked against the model's layers."""
        groups = groups or cls.single(num_layers)
        if len(groups.layer_group) != num_layers:
            raise ValueError(f"KV layer groups of {len(groups.layer_group)} layers for a model of {num_layers}")
        return groups

    @classmethod
    def of(cls, layer_windows: Sequence[int | None], grouped: bool = True) -> "KVGroups":
        """The groups of a model whose layer l attends `layer_windows[l]` tokens back (None: all of them);
        `grouped` False: one table for every layer, which keeps every position's KV."""
        kinds = list(dict.fromkeys(layer_windows))  # in order of first appearance
        if not grouped:
            return cls.single(len(layer_windows))
        if len(kinds) == 1:
            return cls.single(len(layer_windows), kinds[0])
        k = math.gcd(*(layer_windows.count(w) for w in kinds))
        windows, layer_group, layer_slot = [], [], []
        open_group: dict[int | None, tuple[int, int]] = {}  # kind -> (its group being filled, layers in it)
        for w in layer_windows:
            g, n = open_group.get(w, (None, k))
            if n == k:
                g, n = len(windows), 0
                windows.append(w)
            layer_group.append(g)
            layer_slot.append(n)
            open_group[w] = (g, n + 1)
        return cls(tuple(windows), tuple(layer_group), tuple(layer_slot))

    @classmethod
    def for_engine(cls, layer_windows: Sequence[int | None], mode: str, host_kv_pages: int) -> "KVGroups":
        """The groups an engine runs (`engine.kv_groups` `mode`, auto or off): with a host pool (swap, the prefix
        cache's host tier), whose copies move pages of one table, a model of two kinds keeps one table."""
        groups = cls.of(layer_windows, grouped=mode == "auto")
        return cls.single(len(layer_windows)) if groups.num_groups > 1 and host_kv_pages > 0 else groups

    def first_needed(self, group: int, num_computed: int, page_size: int) -> int:
        """The first page a group still needs for a sequence whose next token to compute is at `num_computed`:
        the first page of that token's window (0 for a group without one)."""
        w = self.windows[group]
        return 0 if w is None else max(0, num_computed - w + 1) // page_size

    @staticmethod
    def window_pages(window: int, page_size: int, step_tokens: int = 1) -> int:
        """Pages a sliding group holds for one sequence at most: those a window and a step of `step_tokens` tokens
        span (the window of the step's first token through its last), one more where they straddle a page."""
        return -(-(window + step_tokens - 1) // page_size) + 1

    def seq_units(self, num_tokens: int, page_size: int) -> int:
        """Units a sequence of `num_tokens` tokens holds at most between steps: every page of a group without a
        window; a sliding group's window's pages and the one its next token goes to (never more than it has)."""
        n = -(-num_tokens // page_size)
        return sum(n if w is None else min(n, self.window_pages(w, page_size)) for w in self.windows)

    def seqs_that_fit(self, max_pages: int, num_tokens: int, page_size: int) -> int:
        """Sequences of `num_tokens` tokens a pool of `max_pages` pages (of every layer) holds at once."""
        return self.units(max_pages) // self.seq_units(num_tokens, page_size)

    def tokens_read(self, num_tokens: float) -> float:
        """Tokens of KV a query at position `num_tokens` reads, averaged over the groups (each a window at most)."""
        return sum(num_tokens if w is None else min(num_tokens, w) for w in self.windows) / self.num_groups

    def pages_for_seqs(self, num_seqs: int, num_tokens: int, page_size: int) -> int:
        """Pages (of every layer) that hold `num_seqs` sequences of `num_tokens` tokens at once."""
        return self.as_pages(num_seqs * self.seq_units(num_tokens, page_size))


def held(pages: list[list[int]]) -> list[int]:
    """The pages a sequence's page lists (one per group) hold: every group's, the ones given back left out."""
    return [p for group in pages for p in group if p != NONE]
