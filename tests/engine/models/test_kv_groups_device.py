"""The device side of per-group page tables (engine/kv/kv_groups.py): a tiny Gemma 3 whose sliding layers give
back their slid-out pages computes the same bits as with one page table for every layer, and the pool's copies move
whole units."""

from __future__ import annotations

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine.config import EngineConfig
from engine.device.multi_step import DecodeRow
from engine.device.runner import ModelRunner, RowSampling, SeqChunk
from engine.device.runner_config import RunnerConfig
from engine.device.transfers import TransferLedger
from engine.kv.kv_cache import KVCache
from engine.kv.kv_groups import NONE, KVGroups
from engine.models.weights import load_transformer
from tests.engine.models.hf_reference import make_hf_model

PAGE, WINDOW = 4, 8
# Sliding and full layers 4 : 2: two layers a unit, three groups (sliding 0-1, full 2 and 5, sliding 3-4).
LAYER_TYPES = ["sliding_attention"] * 2 + ["full_attention"] + ["sliding_attention"] * 2 + ["full_attention"]
PROMPT_LENS = (1, 7, 8, 9, 23, 37, 60)
CHUNK = 16  # prompt tokens a sequence takes per step: later chunks start past the window
DECODE_STEPS = 5  # single decode steps, then one multi-step call of as many more
CONFIG = dict(page_size=PAGE, max_pages=160, max_seqs=8, max_seq_len=128)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma3")
    make_hf_model("gemma3_text", path, vocab=512, layers=len(LAYER_TYPES), layer_types=LAYER_TYPES,
                  sliding_window=WINDOW)
    return load_transformer(path)


class Pages:
    """The scheduler's part, played here: each sequence's units in each group, drawn from a shuffled free list, and
    a sliding group's pages given back (to random places in the list, for other sequences to reuse) once they are
    wholly before the window of the next token to compute."""

    def __init__(self, groups: KVGroups, units: int, seed: int) -> None:
        self.groups, self.rng = groups, np.random.default_rng(seed)
        self.free = self.rng.permutation(units).tolist()
        self.held: list[list[list[int]]] = []
        self.given_back = 0

    def before_step(self, s: int, start: int, end: int) -> list[list[int]]:
        """Sequence s's page lists for a step computing its positions [start, end)."""
        if s == len(self.held):
            self.held.append([[] for _ in range(self.groups.num_groups)])
        for g, pages in enumerate(self.held[s]):
            for p in range(min(self.groups.first_needed(g, start, PAGE), len(pages))):
                if pages[p] != NONE:
                    self.free.insert(int(self.rng.integers(len(self.free) + 1)), pages[p])
                    pages[p] = NONE
                    self.given_back += 1
        for g in self.rng.permutation(self.groups.num_groups):  # groups take their units in a different order
            while len(self.held[s][g]) * PAGE < end:
                self.held[s][g].append(self.free.pop())
        return [list(p) for p in self.held[s]]


def run(model, groups: KVGroups | None, impl: str, seed: int, mesh=None) -> tuple[list[np.ndarray], int]:
    """Prompts in chunks, several sequences a step, then single decode steps and one multi-step call: each step's
    logits (the multi-step call's tokens and logprobs), and the pages given back."""
    runner = ModelRunner(model, RunnerConfig.of(EngineConfig(**CONFIG, attention_impl=impl), groups), max_seq_len=128,
                         mesh=mesh)
    pages = Pages(runner.kv_groups, runner.kv.num_pages, seed)
    rng = np.random.default_rng(0)
    tokens = [rng.integers(3, 500, n).tolist() for n in PROMPT_LENS]
    cached, out = [0] * len(tokens), []
    while any(c < len(t) for c, t in zip(cached, tokens)):
        chunks, owners = [], []
        for s, t in enumerate(tokens):
            if cached[s] < len(t):
                end = min(cached[s] + CHUNK, len(t))
                chunks.append(SeqChunk(t[cached[s]:end], cached[s], pages.before_step(s, cached[s], end)))
                owners.append(s)
                cached[s] = end
        out.append(runner.logits(chunks))
    for _ in range(DECODE_STEPS):
        for s, t in enumerate(tokens):  # the same random next tokens in both runs
            t.append(int(rng.integers(3, 500)))
        chunks = [SeqChunk(t[-1:], len(t) - 1, pages.before_step(s, len(t) - 1, len(t))) for s, t in enumerate(tokens)]
        out.append(runner.logits(chunks))
    rows = [DecodeRow(t[-1], len(t) - 1, pages.before_step(s, len(t) - 1, len(t) - 1 + DECODE_STEPS), DECODE_STEPS,
                      RowSampling(0.0, 0, 1.0, np.zeros(2, np.uint32), len(t))) for s, t in enumerate(tokens)]
    new, logprobs, steps = runner.fetch_multi_step(runner.dispatch_multi_step(rows, (), DECODE_STEPS))
    assert (steps == DECODE_STEPS).all()
    return out + [new, logprobs], pages.given_back


@pytest.mark.parametrize("impl", ["reference", "cpu_kernel"])
def test_grouped_page_tables_give_the_bits_of_one_table(gemma3, impl):
    cfg = gemma3.config
    groups = KVGroups.of(cfg.layer_windows())
    assert (groups.num_groups, groups.layers_per_unit) == (3, 2)
    one, kept = run(gemma3, None, impl, seed=1)
    grouped, given_back = run(gemma3, groups, impl, seed=2)
    assert kept == 0 and given_back > 50 and len(one) == len(grouped)
    for step, (a, b) in enumerate(zip(one, grouped)):
        assert np.array_equal(a, b), f"{impl}: step {step}"


def test_scanned_layers_over_four_devices_read_their_groups_tables(tmp_path, monkeypatch):
    """The layers as one scanned program (a traced layer index picks its group and slot) with attention per device
    at `model: 4`: two groups of one full-attention layer each give the bits of one table."""
    import dataclasses

    import engine.device.runner as runner_module
    from engine.distributed import slice_mesh
    from engine.models.presets import PRESETS, write_model

    monkeypatch.setattr(runner_module, "unstack_layers", lambda model: model)
    kv4 = dataclasses.replace(PRESETS["tiny-llama"], num_attention_heads=8, num_key_value_heads=4, head_dim=8)
    mesh = slice_mesh(4)
    model = load_transformer(write_model(kv4, tmp_path / "kv4"), mesh=mesh)
    assert not isinstance(model.layers, tuple) and model.config.num_layers == 2
    two = KVGroups((None, None), (1, 0), (0, 0))  # layer 0 reads the second table
    one, _ = run(model, None, "reference", seed=1, mesh=mesh)
    grouped, _ = run(model, two, "reference", seed=2, mesh=mesh)
    for step, (a, b) in enumerate(zip(one, grouped)):
        assert np.array_equal(a, b), f"step {step}"


def test_a_token_in_a_page_given_back_is_refused(gemma3):
    cfg = gemma3.config
    groups = KVGroups.of(cfg.layer_windows())
    runner = ModelRunner(gemma3, RunnerConfig.of(EngineConfig(**CONFIG), groups), max_seq_len=128)
    inputs = runner.build_inputs([SeqChunk([5, 6], 12, [[NONE, 3, 4, 5], [7, 8, 9, 10], [NONE, NONE, 11, 12]])])
    assert inputs.page_indices.shape == (3, 8, runner.pages_per_seq) and inputs.slot_mapping.shape[0] == 3
    np.testing.assert_array_equal(inputs.page_indices[:, 0, :4], [[0, 3, 4, 5], [7, 8, 9, 10], [0, 0, 11, 12]])
    np.testing.assert_array_equal(inputs.slot_mapping[:, :2], [[20, 21], [40, 41], [48, 49]])
    with pytest.raises(ValueError, match="chunk 0: position 12 is in a page it no longer holds in KV layer group 2"):
        runner.build_inputs([SeqChunk([5], 12, [[3, 4, 5, 6], [7, 8, 9, 10], [NONE] * 4])])
    with pytest.raises(ValueError, match="2 page lists for 3 KV layer groups"):
        runner.build_inputs([SeqChunk([5], 0, [[3], [4]])])
    with pytest.raises(ValueError, match="KV layer groups of 3 layers for a model of 6"):
        ModelRunner(gemma3, RunnerConfig.of(EngineConfig(**CONFIG), KVGroups.single(3)), max_seq_len=128)


GROUPS = KVGroups.of([8, 8, None, 8, 8, None])  # k = 2: slots 0 and 1 of every unit
CFG = SimpleNamespace(num_layers=6, num_kv_heads=2, head_dim=8)


def _filled(kv: KVCache) -> np.ndarray:
    values = np.arange(kv.pool.array.size, dtype=np.float32).reshape(kv.pool.array.shape)
    kv.pool = kv.pool.__class__(jax.device_put(values, kv.pool.array.sharding), kv.pool.axes)
    return values


def test_copy_pages_copies_every_slot_of_a_unit_and_nothing_else():
    units = GROUPS.units(5)
    kv = KVCache(CFG, units, 4, TransferLedger(), jnp.float32, groups=GROUPS)
    assert kv.pool.array.shape[0] == 2 * units == 6 * 5 and kv.num_layers == 2
    before = _filled(kv)
    kv.copy_pages([3, 11], [14, 0])
    expected = before.copy()
    for slot in range(2):
        expected[slot * units + 14] = before[slot * units + 3]
        expected[slot * units + 0] = before[slot * units + 11]
    np.testing.assert_array_equal(np.asarray(kv.pool.array), expected)


def test_page_out_then_page_in_moves_every_slot_of_a_unit():
    units = GROUPS.units(4)
    kv = KVCache(CFG, units, 2, TransferLedger(), jnp.float32, host_pages=2, groups=GROUPS)
    assert kv.num_host_pages == 6  # two pages of every layer: three units each
    before = _filled(kv)
    kv.page_out([1, 9, 10], [5, 0, 3])
    kv.finish_page_outs()
    kv.page_in([5, 0, 3], [2, 7, 11])
    after = np.asarray(kv.pool.array)
    expected = before.copy()
    for slot in range(2):
        for src, dst in ((1, 2), (9, 7), (10, 11)):
            expected[slot * units + dst] = before[slot * units + src]
    np.testing.assert_array_equal(after, expected)
