"""The host KV pool (engine/kv/kv_cache.py): page-out then page-in is bit-exact, and the ledger counts its bytes."""

from __future__ import annotations

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.kv.kv_cache import KVCache, host_memory_kind
from engine.device.transfers import TransferLedger

CFG = SimpleNamespace(num_layers=3, num_kv_heads=2, head_dim=8)


def _bits(x: np.ndarray) -> np.ndarray:
    return np.asarray(x).view(np.uint16 if np.asarray(x).dtype.itemsize == 2 else np.uint32)


def _random_pool(kv: KVCache, rng: np.random.Generator) -> np.ndarray:
    values = rng.standard_normal(kv.pool.array.shape).astype(np.float32)
    values.reshape(-1)[:7] = [np.nan, np.inf, -np.inf, -0.0, 1e-45, 3.4e38, -1e-40]  # odd bits travel too
    kv.pool = kv.pool.__class__(jax.device_put(values.astype(kv.pool.array.dtype), kv.pool.array.sharding), kv.pool.axes)
    return np.asarray(kv.pool.array)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(page_size=st.sampled_from([1, 2, 4, 16]), num_pages=st.integers(2, 12), host_pages=st.integers(1, 12),
       dtype=st.sampled_from(["float32", "bfloat16"]), memory_kind=st.sampled_from([True, None]), data=st.data())
def test_page_out_then_page_in_is_bit_exact(page_size, num_pages, host_pages, dtype, memory_kind, data):
    """Random device pages go to random host pages; the device pages are then overwritten (the step that
    reuses them), and the host pages come back into other random device pages: every layer's bits equal."""
    ledger = TransferLedger()
    kv = KVCache(CFG, num_pages, page_size, ledger, getattr(jnp, dtype), host_pages=host_pages,
                 memory_kind=memory_kind)  # through pinned host memory (this CPU has it) or numpy
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    before = _random_pool(kv, rng)
    n = data.draw(st.integers(1, min(num_pages, host_pages)))
    src = data.draw(st.permutations(range(num_pages)))[:n]
    host = data.draw(st.permutations(range(host_pages)))[:n]
    kv.page_out(src, host)
    after_step = _random_pool(kv, rng)  # the pages are reused before the page-out lands on the host
    kv.finish_page_outs()
    dst = data.draw(st.permutations(range(num_pages)))[:n]
    kv.page_in(host, dst)
    got = np.asarray(kv.pool.array)
    L = CFG.num_layers
    for layer in range(L):
        for s, d in zip(src, dst):
            np.testing.assert_array_equal(_bits(got[layer * num_pages + d]), _bits(before[layer * num_pages + s]))
        for p in set(range(num_pages)) - set(dst):  # every other page is untouched by the page-in
            np.testing.assert_array_equal(_bits(got[layer * num_pages + p]), _bits(after_step[layer * num_pages + p]))
    d2h, h2d = ledger.end_call()
    page_bytes = before[0].nbytes  # copies go in power-of-two pieces: no padding page crosses
    assert d2h == {"swap": L * n * page_bytes}
    assert h2d["swap"] == L * n * page_bytes + 2 * n * 4  # the pages, and each direction's page indices


def test_pending_page_outs_land_before_a_page_in_reads_them():
    """Two page-outs pending at once: a page-in of their host pages gets the pages they copied."""
    ledger = TransferLedger()
    kv = KVCache(CFG, 6, 4, ledger, jnp.float32, host_pages=4)
    before = _random_pool(kv, np.random.default_rng(0))
    kv.page_out([5, 0], [3, 1])
    kv.page_out([2], [0])
    kv.page_in([0, 3, 1], [1, 2, 3])  # no finish_page_outs: the page-in copies from the blocks in flight
    got = np.asarray(kv.pool.array)
    for layer in range(CFG.num_layers):
        for s, d in ((2, 1), (5, 2), (0, 3)):
            np.testing.assert_array_equal(_bits(got[layer * 6 + d]), _bits(before[layer * 6 + s]))


@pytest.mark.parametrize("memory_kind", [True, None])
def test_a_page_in_ahead_lands_only_when_asked_bit_exact(memory_kind):
    """`page_in_ahead` sends the pages and leaves the pool alone (the call that issues it may run meanwhile);
    `land_page_ins` writes them, bit for bit."""
    kv = KVCache(CFG, 6, 4, TransferLedger(), jnp.float32, host_pages=4, memory_kind=memory_kind)
    before = _random_pool(kv, np.random.default_rng(5))
    kv.page_out([1, 4], [2, 0])
    kv.finish_page_outs()
    step = _random_pool(kv, np.random.default_rng(6))
    kv.page_in_ahead([0, 2], [3, 5])
    assert kv.has_page_ins_ahead
    np.testing.assert_array_equal(_bits(np.asarray(kv.pool.array)), _bits(step))  # nothing written yet
    kv.land_page_ins()
    assert not kv.has_page_ins_ahead
    got = np.asarray(kv.pool.array)
    for layer in range(CFG.num_layers):
        for s, d in ((4, 3), (1, 5)):
            np.testing.assert_array_equal(_bits(got[layer * 6 + d]), _bits(before[layer * 6 + s]))
        for p in (0, 1, 2, 4):
            np.testing.assert_array_equal(_bits(got[layer * 6 + p]), _bits(step[layer * 6 + p]))


def test_page_moves_pass_the_transfer_guard():
    """Only the ledger's transfers cross: a swap moves nothing it does not count."""
    ledger = TransferLedger()
    kv = KVCache(CFG, 4, 2, ledger, jnp.float32, host_pages=2)
    _random_pool(kv, np.random.default_rng(1))
    with jax.transfer_guard("disallow"):
        kv.page_out([1, 2], [0, 1])
        kv.finish_page_outs()
        kv.page_in([1, 0], [0, 3])


@pytest.mark.parametrize("memory_kind", [True, None])
@pytest.mark.parametrize("model,data", [(2, 2), (4, 1), (1, 4)])
def test_a_sharded_pool_pages_out_and_in_by_shard(model, data, memory_kind):
    """On a mesh the host pool holds one array per distinct shard of the device pool (a replica kept once), as a
    host of a multi-host slice holds only its own: the round trip is bit-exact and moves each page's bytes once."""
    cfg = SimpleNamespace(num_layers=3, num_kv_heads=4, head_dim=8)
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(data, model), ("data", "model"))
    ledger = TransferLedger()
    kv = KVCache(cfg, 6, 4, ledger, jnp.float32, mesh=mesh, host_pages=5, memory_kind=memory_kind)
    assert len(kv.host.shards) == model and sum(a[0].nbytes for a in kv.host.shards.values()) == 4 * 2 * 4 * 8 * 4
    before = _random_pool(kv, np.random.default_rng(3))
    kv.page_out([5, 0, 2], [3, 1, 4])
    _random_pool(kv, np.random.default_rng(4))
    kv.finish_page_outs()
    kv.page_in([1, 4, 3], [2, 3, 0])
    assert kv.pool.array.sharding == kv._sharding
    got = np.asarray(kv.pool.array)
    for layer in range(3):
        for s, d in ((0, 2), (2, 3), (5, 0)):
            np.testing.assert_array_equal(_bits(got[layer * 6 + d]), _bits(before[layer * 6 + s]))
    d2h, h2d = ledger.end_call()
    assert d2h == {"swap": 3 * 3 * before[0].nbytes}


def test_host_memory_kind_is_pinned_host_where_every_device_has_it():
    """The one choice of how page copies travel (engine/kv/kv_cache.py): this JAX's CPU backend has `pinned_host`,
    so the tests run the TPU's path; a device without it (or without memories at all) gets numpy transfers."""
    assert host_memory_kind(jax.local_devices()) == "pinned_host"
    assert KVCache(CFG, 4, 2, TransferLedger(), jnp.float32, host_pages=2).memory_kind == "pinned_host"

    def device(*kinds):
        return SimpleNamespace(addressable_memories=lambda: [SimpleNamespace(kind=k) for k in kinds])

    assert host_memory_kind([device("device", "pinned_host"), device("device", "pinned_host")]) == "pinned_host"
    assert host_memory_kind([device("device", "pinned_host"), device("device", "unpinned_host")]) is None
    assert host_memory_kind([device("device")]) is None
    assert host_memory_kind([SimpleNamespace()]) is None


@pytest.mark.parametrize("memory_kind", [True, None])
def test_a_page_in_of_pages_in_flight_reads_nothing_back(memory_kind, monkeypatch):
    """Overlap: a page-in never waits for a page-out. Pages whose page-out is in flight come from its device
    block, the others from the host pool; no device-to-host read happens until `finish_page_outs`, and the
    pages are bit-exact, through pinned host memory or numpy."""
    ledger = TransferLedger()
    kv = KVCache(CFG, 6, 4, ledger, jnp.float32, host_pages=5, memory_kind=memory_kind)
    assert kv.memory_kind == (None if memory_kind is None else "pinned_host")
    rng = np.random.default_rng(2)
    first = _random_pool(kv, rng)
    kv.page_out([4], [4])
    kv.finish_page_outs()  # host page 4 holds page 4 of `first`
    before = _random_pool(kv, rng)
    kv.page_out([5, 0], [3, 1])
    kv.page_out([2], [3])  # host page 3 written twice in flight: the later page-out wins
    reads = []
    monkeypatch.setattr(ledger, "read", lambda **a: reads.append(a) or pytest.fail("a page-in read a page back"))
    with jax.transfer_guard("disallow"):
        kv.page_in([3, 1, 4], [1, 2, 3])
    got = np.asarray(kv.pool.array)
    assert reads == []
    for layer in range(CFG.num_layers):
        for s, d, pool in ((2, 1, before), (0, 2, before), (4, 3, first)):
            np.testing.assert_array_equal(_bits(got[layer * 6 + d]), _bits(pool[layer * 6 + s]))
    monkeypatch.undo()
    kv.finish_page_outs()
    np.testing.assert_array_equal(_bits(kv.host_pool[kv._host_rows(np.array([3]))]),
                                  _bits(before[np.arange(CFG.num_layers) * 6 + 2]))


def test_a_host_pool_larger_than_the_hosts_memory_is_refused_naming_the_key():
    """The host pool maps its pages lazily, so a pool too large for the host would start and fail only when
    it fills; it is refused at once, as a configuration error that names engine.host_kv_pages and its bound."""
    from engine import PoolTooLarge
    from engine.sizing.machine_sizing import mem_available_bytes

    page_bytes = CFG.num_layers * 4 * 2 * CFG.num_kv_heads * CFG.head_dim * 4  # page_size 4, float32
    too_many = 4 * mem_available_bytes() // page_bytes
    with pytest.raises(PoolTooLarge, match=r"engine\.host_kv_pages=[\d,]+ takes .* GiB .* at most [\d,]+$"):
        KVCache(CFG, 4, 4, TransferLedger(), host_pages=too_many)
    kv = KVCache(CFG, 4, 4, TransferLedger(), host_pages=mem_available_bytes() // page_bytes // 4)
    assert kv.num_host_pages > 0  # a pool that fits starts, and costs nothing until it fills


def test_a_device_pool_larger_than_the_memory_is_refused_naming_the_key(monkeypatch):
    """On the CPU the device pool is host memory, zeroed at start: one too large for it is refused before the
    allocation (which would fail, or have the kernel kill the process), naming engine.max_pages. Where there is
    no such check (an accelerator), the device's own refusal becomes the same error."""
    import engine.kv.kv_cache
    from engine import PoolTooLarge
    from engine.sizing.machine_sizing import mem_available_bytes

    page_bytes = CFG.num_layers * 4 * 2 * CFG.num_kv_heads * CFG.head_dim * 4
    with pytest.raises(PoolTooLarge, match=r"^engine\.max_pages=[\d,]+ takes .* at most [\d,]+$"):
        KVCache(CFG, 4 * mem_available_bytes() // page_bytes, 4, TransferLedger())
    monkeypatch.setattr(engine.kv.kv_cache, "check_fits", lambda *args: None)
    with pytest.raises(PoolTooLarge, match=r"^engine\.max_pages=[\d,]+ takes .*RESOURCE_EXHAUSTED.*kv_memory_gib lower$"):
        KVCache(CFG, 1 << 40, 4, TransferLedger())
