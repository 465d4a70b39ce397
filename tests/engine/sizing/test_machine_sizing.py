"""Engines sized for the machine: capacities from a KV memory budget, explicit values kept."""

from __future__ import annotations

import pytest

from engine.sizing.capacity import pages_for
from engine.config import EngineConfig
from engine.sizing.machine_sizing import MAX_SEQS, GiB, Machine, size_for_machine, weight_bytes
from engine.sizing.model_bytes import kv_bytes_per_token
from engine.models.model_config import ModelConfig

LLAMA_40M = ModelConfig.from_hf({"model_type": "llama", "hidden_size": 512, "intermediate_size": 1536,
                                 "num_hidden_layers": 10, "num_attention_heads": 8, "num_key_value_heads": 4,
                                 "head_dim": 64, "vocab_size": 8192, "max_position_embeddings": 4096})
PAGE_BYTES = 16 * 2 * 10 * 4 * 64 * 4  # page_size * K and V * layers * kv_heads * head_dim * float32


def test_a_cpu_engine_takes_a_quarter_of_available_memory_and_at_most_128_slots():
    cfg = size_for_machine(EngineConfig(), LLAMA_40M, "float32", Machine("cpu", 20 * GiB))
    assert kv_bytes_per_token(LLAMA_40M, 4) * 16 == PAGE_BYTES
    assert cfg.max_pages == 5 * GiB // PAGE_BYTES == 16384
    assert cfg.max_seqs == 64 and cfg.max_prefill_size == 4096  # 16384 pages hold 64 sequences of 4,096 tokens
    assert cfg.max_seqs_in_prefill == 64  # the 4,096-token budget bounds a step, not a count of prompts


def test_slots_are_capped_so_that_every_sequence_fits_at_full_length():
    cfg = size_for_machine(EngineConfig(max_seq_len=4096), LLAMA_40M, "float32", Machine("cpu", 2 * GiB))
    assert cfg.max_pages == GiB // 2 // PAGE_BYTES == 1638
    assert cfg.max_seqs == 4 and cfg.max_seqs_in_prefill == 4  # 1638 // 256 = 6 sequences: a power of two below
    assert cfg.max_seqs * pages_for(4096, cfg.page_size) <= cfg.max_pages


def test_an_accelerator_gives_a_share_of_its_memory_less_the_weights_and_256_slots():
    machine = Machine("accelerator", 16 * GiB)
    cfg = size_for_machine(EngineConfig(max_seq_len=1024), LLAMA_40M, "bfloat16", machine)
    budget = int(0.9 * 16 * GiB) - weight_bytes(LLAMA_40M, "bfloat16")
    assert cfg.max_pages == budget // (PAGE_BYTES // 2)
    assert cfg.max_seqs == 256 and cfg.max_prefill_size == 8192


def test_kv_memory_gib_and_explicit_values_win():
    machine = Machine("cpu", 20 * GiB)
    cfg = size_for_machine(EngineConfig(kv_memory_gib=0.5), LLAMA_40M, "float32", machine)
    assert cfg.max_pages == GiB // 2 // PAGE_BYTES
    given = EngineConfig(max_pages=300, max_seqs=3, max_prefill_size=100, max_seqs_in_prefill=2)
    cfg = size_for_machine(given, LLAMA_40M, "float32", machine,
                           frozenset({"max_pages", "max_seqs", "max_prefill_size", "max_seqs_in_prefill"}))
    assert cfg == given
    cfg = size_for_machine(EngineConfig(max_seqs=16), LLAMA_40M, "float32", machine, frozenset({"max_seqs"}))
    assert cfg.max_seqs == 16 and cfg.max_pages == 16384


def test_a_known_workload_counts_slots_at_its_longest_sequence_and_cuts_the_pool_to_what_they_use():
    machine = Machine("cpu", 20 * GiB)  # 16384 pages
    cfg = size_for_machine(EngineConfig(), LLAMA_40M, "float32", machine, longest=576)  # 36 pages a sequence
    cpu_slots = MAX_SEQS["cpu"]
    assert (cfg.max_seqs, cfg.max_pages, cfg.max_seq_len) == (cpu_slots, cpu_slots * 36, 576)  # 455 fit: the cap
    for sequences, slots in ((3, 4), (64, 64), (65, cpu_slots), (10_000, cpu_slots), (0, 1)):  # slots the job fills
        cfg = size_for_machine(EngineConfig(), LLAMA_40M, "float32", machine, longest=576, sequences=sequences)
        assert (cfg.max_seqs, cfg.max_pages, cfg.max_seqs_in_prefill) == (slots, slots * 36, slots)
    cfg = size_for_machine(EngineConfig(max_seqs=8), LLAMA_40M, "float32", machine, frozenset({"max_seqs"}), longest=576)
    assert (cfg.max_seqs, cfg.max_pages) == (8, 8 * 36)
    small = Machine("cpu", 4 * 36 * PAGE_BYTES * 3)  # a budget of 108 pages: 3 sequences of 576 tokens, 2 slots
    cfg = size_for_machine(EngineConfig(), LLAMA_40M, "float32", small, longest=576)
    assert (cfg.max_seqs, cfg.max_pages) == (2, 72)
    cfg = size_for_machine(EngineConfig(max_pages=500), LLAMA_40M, "float32", machine, frozenset({"max_pages"}),
                           longest=576)
    assert cfg.max_pages == 500  # an explicit pool is kept
    cfg = size_for_machine(EngineConfig(max_seq_len=256), LLAMA_40M, "float32", machine, longest=10_000)
    assert (cfg.max_pages, cfg.max_seq_len) == (cpu_slots * 16, 256)  # never past max_seq_len: longer ones are too_long
    cfg = size_for_machine(EngineConfig(max_seq_len=1024, max_seqs=8), LLAMA_40M, "float32", machine,
                           frozenset({"max_seq_len", "max_seqs"}), longest=16)
    assert (cfg.max_pages, cfg.max_seq_len) == (64, 1024)  # 8 slots of 1 page, but one whole sequence still fits
    with pytest.raises(ValueError, match="the input's longest sequence, 576 tokens needs"):
        size_for_machine(EngineConfig(), LLAMA_40M, "float32", Machine("cpu", 4 * 30 * PAGE_BYTES), longest=576)


def test_a_budget_below_one_sequence_names_the_keys_to_change():
    with pytest.raises(ValueError, match="engine.kv_memory_gib or engine.max_pages higher, or engine.max_seq_len lower"):
        size_for_machine(EngineConfig(kv_memory_gib=0.01), LLAMA_40M, "float32", Machine("cpu", 20 * GiB))


def test_kv_memory_gib_must_be_positive():
    with pytest.raises(ValueError, match="engine.kv_memory_gib must be positive"):
        EngineConfig(kv_memory_gib=0)
