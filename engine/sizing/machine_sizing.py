"""Engine capacities sized for the machine it runs on (`pagefleet generate`), from a KV memory budget.

A run (`pagefleet run`) never uses this: its capacities are explicit config values, identical on every
host, and never derived from one host's free memory. An engine alone in one process may instead fill
the machine, as vLLM does, and this module says how. Every value the caller set explicitly is kept.

- **KV budget.** `engine.kv_memory_gib` when set; otherwise a share of memory: on CPU
  `CPU_KV_SHARE` of the memory available now (`MemAvailable`), on an accelerator `ACCEL_MEMORY_SHARE`
  of the first device's memory limit less the weights (vLLM's `gpu_memory_utilization` reading).
- **Pages.** `max_pages = floor(budget / (page_size * kv_bytes_per_token))`, where one token's K and V
  in every layer take `2 * layers * kv_heads * head_dim * dtype_bytes` bytes (engine/kv/kv_cache.py's pool).
- **Slots.** `max_seqs` is the platform's cap (`MAX_SEQS`), lowered to the largest power of two whose
  sequences all fit at `max_seq_len` (no preemption however long they grow), each holding its layer groups' pages
  (engine/kv/kv_groups.py: a sliding-window layer holds its window's, engine.kv_groups). On an accelerator decoding
  is memory-bound, so more rows are nearly free: 256, vLLM's default. On CPU a step is compute-bound:
  128, because a decode step's matmuls of 128 rows run nearer the cores' peak than those of 64 (bench-peer's
  plain and shared-prefix jobs ran 6% faster on 128 slots than on 64, tokens identical; 256 slots were
  between: a 256-prompt job on 256 slots spends more of its steps filling them).
- **Token budget.** `max_prefill_size` is the platform's step size (`STEP_TOKENS`): large enough that a
  prompt chunk's matmuls run near peak, the CPU's at 4,096 tokens as vLLM's CPU build schedules them.
- **The workload's bound.** When the caller knows its workload (`generate` reads every prompt before it builds
  the engine), `longest` is the most tokens one of its sequences can reach (its prompt plus its
  `max_new_tokens`). Slots are then counted at that length instead of `max_seq_len`, `max_seq_len` itself
  becomes that length (unless set), and the pool is cut to what those slots can use at once,
  `max_seqs` such sequences' pages: a job of short prompts does not zero
  (and keep) a pool sized for the model's whole context. Zeroing the CPU's quarter of memory took 2.6-5.6 s of
  a 75-second job. Knowing how many sequences the workload runs (`sequences`: its samples), slots stop at the
  power of two that holds them: a 64-prompt job on 64 slots, not 128 (a smaller pool, and page tables the size of
  the job).
- **Prompts per step.** `max_seqs_in_prefill` is `max_seqs`: the token budget alone bounds a step, as in
  vLLM. With the run path's default of 8, short prompts, or prompts whose prefix the cache serves (a
  90-token tail behind a 1,270-token cached block), left most of a 4,096-token step empty.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from engine.sizing.capacity import max_seq_len, pages_for
from engine.config import EngineConfig
from engine.kv.kv_groups import KVGroups
from engine.sizing.model_bytes import DTYPE_BYTES, GiB, count_params, kv_page_bytes
from engine.models.model_config import ModelConfig


CPU_KV_SHARE = 0.25
"""Of the host memory available when the engine starts, the share its KV pool may take."""
ACCEL_MEMORY_SHARE = 0.9
"""Of an accelerator's memory, the share weights and KV pool may take together (the rest: activations, XLA)."""
MAX_SEQS = {"cpu": 128, "accelerator": 256}
"""Most slots per platform (before the memory cap)."""
STEP_TOKENS = {"cpu": 4096, "accelerator": 8192}
"""Tokens per step (engine.max_prefill_size) per platform."""

SIZED_KEYS = ("max_seq_len", "max_pages", "max_seqs", "max_prefill_size", "max_seqs_in_prefill")
"""The capacities this module sizes; an explicit value of any of them is kept."""


@dataclass(frozen=True)
class Machine:
    """What the sizing reads from the machine (a value, so that tests can give their own)."""

    platform: str
    """`cpu` or `accelerator`."""
    memory_bytes: int
    """CPU: host memory available now; accelerator: the first device's memory limit."""


def this_machine() -> Machine:
    """The backend JAX runs on here and its memory (reads /proc/meminfo on CPU)."""
    import jax

    device = jax.devices()[0]
    if device.platform == "cpu":
        return Machine("cpu", mem_available_bytes())
    stats = device.memory_stats() or {}
    return Machine("accelerator", int(stats.get("bytes_limit", 0)))


def mem_available_bytes() -> int:
    """Host memory available now (MemAvailable of /proc/meminfo); raises RuntimeError where there is none."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo has no MemAvailable line; set engine.kv_memory_gib")


def weight_bytes(model: ModelConfig, dtype: str) -> int:
    """Parameters of a Llama-family model (attention, MLP, norms, embeddings, lm_head) in `dtype`."""
    return count_params(model).total * DTYPE_BYTES[dtype]


def kv_memory_bytes(config: EngineConfig, model: ModelConfig, dtype: str, machine: Machine) -> int:
    """The KV pool's budget: engine.kv_memory_gib, else the machine's share (see the module docstring)."""
    if config.kv_memory_gib is not None:
        return int(config.kv_memory_gib * GiB)
    if machine.platform == "cpu":
        return int(CPU_KV_SHARE * machine.memory_bytes)
    return int(ACCEL_MEMORY_SHARE * machine.memory_bytes) - weight_bytes(model, dtype)


def size_for_machine(config: EngineConfig, model: ModelConfig, dtype: str, machine: Machine,
                     explicit: frozenset[str] = frozenset(), longest: int | None = None,
                     sequences: int | None = None) -> EngineConfig:
    """`config` with max_pages, max_seqs and max_prefill_size sized for `machine`, except those in `explicit`
    (engine keys the caller set). `longest`: the most tokens any sequence of the workload can reach, when the
    caller knows it (see the module docstring); None: any length up to max_seq_len. `sequences`: how many sequences
    the workload runs in all, when the caller knows it: slots past them would stay empty. Raises ValueError, naming
    the key to set, when one sequence of that many tokens does not fit the budget."""
    limit = max_seq_len(config, model.max_position_embeddings)
    seq_len, what = limit, f"engine.max_seq_len={limit}"
    if longest is not None and longest < limit:
        seq_len, what = max(1, longest), f"the input's longest sequence, {max(1, longest)}"
    seq_pages = pages_for(seq_len, config.page_size)  # one table's; a pool smaller than one sequence is refused
    groups = KVGroups.for_engine(model.layer_windows(), config.kv_groups, config.host_kv_pages)
    changes: dict[str, int] = {}
    max_pages = config.max_pages
    if "max_pages" not in explicit:
        budget = kv_memory_bytes(config, model, dtype, machine)
        max_pages = max(0, budget) // kv_page_bytes(model, DTYPE_BYTES[dtype], config.page_size)
        if max_pages < seq_pages:
            raise ValueError(
                f"a KV budget of {budget / GiB:.2f} GiB holds {max_pages} pages of {config.page_size} tokens, fewer "
                f"than one sequence of {what} tokens needs ({seq_pages}); set "
                f"engine.kv_memory_gib or engine.max_pages higher, or engine.max_seq_len lower")
        changes["max_pages"] = max_pages
    if "max_seqs" not in explicit:
        fit = groups.seqs_that_fit(max_pages, seq_len, config.page_size)  # all at full length: no preemption
        cap = MAX_SEQS[machine.platform]
        if sequences is not None:  # the power of two that holds them all
            cap = min(cap, 1 << (max(1, sequences) - 1).bit_length())
        changes["max_seqs"] = max(1, min(cap, 2 ** int(math.log2(max(fit, 1)))))
    if "max_prefill_size" not in explicit:
        changes["max_prefill_size"] = STEP_TOKENS[machine.platform]
    if longest is not None:
        if "max_seq_len" not in explicit:  # no sequence of the input is longer: the page tables shrink to it
            changes["max_seq_len"] = limit = seq_len
        if "max_pages" not in explicit:  # no more pages than the slots can use at once (and one whole sequence)
            slots = groups.pages_for_seqs(changes.get("max_seqs", config.max_seqs), seq_len, config.page_size)
            changes["max_pages"] = min(max_pages, max(slots, pages_for(limit, config.page_size)))
    if "max_seqs_in_prefill" not in explicit:
        changes["max_seqs_in_prefill"] = changes.get("max_seqs", config.max_seqs)
    return dataclasses.replace(config, **changes)
