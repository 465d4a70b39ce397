"""pagefleet's JAX paged-attention engine. Its public API is this module: the orchestrator, the benchmarks
and users import `engine` only through the names below.

Light names (configs, requests, the sample record, capacity rules) import without JAX; the rest (the engine
itself, model presets, multi-host set-up, the CPU kernel build) load on first use.
"""

from __future__ import annotations

import importlib

from engine import files

from engine.sizing.capacity import check_pool, length_error, max_seq_len, pages_for, pages_needed, scored_context_shared, scored_length_error, scored_prefill_tokens, scored_sampling_error, stop_ids_error, validate_request
from engine.config import DTYPES, INT32_MAX, EngineConfig, SamplingConfig, SamplingParams
from engine.kv.kv_groups import KVGroups
from engine.sizing.model_bytes import DTYPE_BYTES, GiB, ParamCount, count_params, kv_bytes_per_token, kv_page_bytes
from engine.record import RECORD_FIELDS, RESERVED_COLUMNS, SampleRecord, arrow_fields, output_record
from engine.scheduling.sequence import Request
from engine.sampling.structured import structured_error
from engine.models.model_registry import model_family
from engine.models.tensor_parallel import MeshError, kv_replicas, sharded_config, tensor_parallel_error, valid_widths

_LAZY = {
    "Engine": "engine.engine",
    "ModelConfig": "engine.models.model_config",
    "UnsupportedModelError": "engine.models.model_config",
    "GENERATION_CONFIG": "engine.models.model_config",
    "parse_generation_config": "engine.models.model_config",
    "eos_token_ids": "engine.models.model_config",
    "PRESETS": "engine.models.presets",
    "Preset": "engine.models.presets",
    "write_model": "engine.models.presets",
    "load_tokenizer": "engine.tokenizer.tokenizer_cache",
    "has_tokenizer": "engine.tokenizer.tokenizer_cache",
    "traces": "engine.trace",
    "initialize_distributed": ("engine.distributed", "initialize"),
    "slice_mesh": "engine.distributed",
    "HostsDisagree": "engine.distributed",
    "hosts_agree": ("engine.distributed", "agree"),
    "backend_is_cpu_only": "engine.kernels.kernel_build",
    "start_kernel_build": ("engine.kernels.kernel_build", "start"),
    "size_for_machine": "engine.sizing.machine_sizing",
    "this_machine": "engine.sizing.machine_sizing",
    "SIZED_KEYS": "engine.sizing.machine_sizing",
    "check_checkpoint": "engine.models.checkpoint_check",
    "CheckpointError": "engine.models.checkpoint_check",
    "PoolTooLarge": "engine.kv.host_pool",
    "NON_FINITE_ERROR": "engine.engine",
    "prefix_cache_summary": "engine.stats",
    "PROGRAM_FIGURES": "engine.device.compile_cache",
    "host_kv_summary": "engine.stats",
    "host_kv_counters": "engine.stats",
    "HOST_KV_SUMS": "engine.stats",
    "HOST_KV_PEAK": "engine.stats",
    "transfer_summary": "engine.device.transfers",
    "transfer_counters": "engine.device.transfers",
    "transfer_counter_key": ("engine.device.transfers", "counter_key"),
    "TRANSFER_DIRECTIONS": ("engine.device.transfers", "DIRECTIONS"),
    "sum_transfer_counters": "engine.device.transfers",
    "TPU_TARGETS": ("engine.sizing.preflight", "TARGETS"),
    "LoweringFailed": "engine.sizing.preflight",
    "abstract_mesh": "engine.sizing.preflight",
    "lower_step_programs": "engine.sizing.preflight",
    "sampling_mode": "engine.sizing.preflight",
}

__all__ = ["Engine", "DTYPES", "INT32_MAX", "EngineConfig", "SamplingConfig", "SamplingParams", "Request", "SampleRecord", "RECORD_FIELDS", "RESERVED_COLUMNS", "output_record",
           "arrow_fields", "DTYPE_BYTES", "GiB", "ParamCount", "count_params", "kv_bytes_per_token", "kv_page_bytes", "check_pool", "length_error", "max_seq_len", "pages_for", "pages_needed", "scored_context_shared", "scored_length_error", "scored_prefill_tokens", "scored_sampling_error",
           "stop_ids_error", "structured_error", "validate_request", "MeshError", "KVGroups", "files", "model_family", "kv_replicas", "sharded_config", "tensor_parallel_error", "valid_widths", *[name for name in _LAZY if name != "Engine"]]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    module, attr = _LAZY[name] if isinstance(_LAZY[name], tuple) else (_LAZY[name], name)
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value
    return value
