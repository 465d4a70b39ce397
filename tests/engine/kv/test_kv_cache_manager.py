"""The KV cache manager's API as the scheduler uses it: yes or no for pages, never a raise; copies handed over once."""

import numpy as np

from engine.config import SamplingConfig
from engine.kv.kv_cache_config import KVCacheConfig
from engine.kv.kv_cache_manager import KVCacheManager
from engine.scheduling.sequence import Request, Sequence
from engine.scheduling.stop import StopChecker


def seq(prompt: tuple[int, ...], arrival: int = 0) -> Sequence:
    request = Request(f"p{arrival}", prompt, SamplingConfig(max_new_tokens=4))
    return Sequence(request, arrival, np.zeros(2, np.uint32), StopChecker(max_new_tokens=4, start=len(prompt), decode=lambda ids: ""),
                    token_ids=list(prompt))


def manager(max_pages: int = 4, prefix_caching: bool = False) -> KVCacheManager:
    return KVCacheManager(KVCacheConfig(page_size=4, max_pages=max_pages, host_kv_pages=0,
                                        prefix_caching=prefix_caching, preemption="recompute"))


def test_allocate_says_no_and_takes_nothing_when_the_pages_are_not_free():
    kv, a, b = manager(), seq(tuple(range(1, 11))), seq(tuple(range(1, 11)), 1)
    assert kv.allocate(a, 10) and a.num_pages == 3 and kv.num_free == 1
    assert not kv.allocate(b, 10) and b.pages == [] and kv.num_free == 1
    kv.free(a)
    assert a.pages == [] and kv.num_free == 4 and kv.allocate(b, 10)
    kv.check([b], [])


def test_reserve_is_all_or_nothing():
    kv, a, b = manager(), seq((1, 2)), seq((3, 4), 1)
    assert not kv.reserve([a, b], [3, 2]) and a.pages == b.pages == [] and kv.num_free == 4
    assert kv.reserve([a, b], [3, 0]) and a.num_pages == 3 and b.pages == []


def test_a_fork_shares_the_full_pages_and_its_copy_goes_with_the_next_call_once():
    kv, parent, sibling = manager(3), seq((1, 2, 3, 4, 5, 6)), seq((1, 2, 3, 4, 5, 6), 1)
    assert kv.allocate(parent, 6)
    assert kv.fork(parent, sibling)
    assert sibling.pages[0][0] == parent.pages[0][0] and sibling.pages[0][1] != parent.pages[0][1]
    copies = kv.take_copies()
    assert copies.copies == ([parent.pages[0][1]], [sibling.pages[0][1]]) and copies.swap_out == ([], [])
    assert kv.take_copies().copies == ([], [])
    assert not kv.fork(parent, seq((1, 2, 3, 4, 5, 6), 2))  # no page free for the copy: no, not an error
    kv.check([parent, sibling], [])


def test_a_cached_prefix_is_mapped_for_the_next_prompt_and_a_recompute_frees_it():
    kv, first, second = manager(8, prefix_caching=True), seq(tuple(range(1, 10))), seq(tuple(range(1, 10)), 1)
    assert kv.map_cached(first) == (0, []) and kv.allocate(first, 9)
    kv.cache_pages(first, 9)
    first.num_computed = 9
    hit, hits = kv.map_cached(second)
    assert (hit, hits) == (8, []) and second.pages == [first.pages[0][:2]]
    assert not kv.swap_out(second) and second.pages == [] and second.num_computed == 0  # no host pool: recompute
    kv.check([first], [second])
