"""Sizing engine capacities for a model on a chip: pure arithmetic on config.json, no weights.

`pagefleet size` answers, before any TPU is rented: how many bytes of weights each chip holds,
how many KV pages fit in what is left, how many sequences of the workload's length those pages
hold, and an upper bound on decode throughput from HBM bandwidth.

The rules, per chip of one tensor-parallel group (one engine):

- **Weights.** The engine shards attention (over KV heads) and the MLP over the mesh's `model`
  axis and replicates the rest (token embeddings, an untied lm_head, RMSNorm weights; see
  `engine/models/axes.py` TENSOR_PARALLEL), so a chip holds `replicated + sharded / tp` parameters.
- **KV.** One token's K and V in every layer take `2 * layers * kv_heads * head_dim * dtype_bytes`
  bytes (the pool layout of `engine/kv/kv_cache.py`), split over `tp` chips by KV head. When `tp` exceeds the
  KV heads, each is replicated `tp / kv_heads` times (`engine/models/tensor_parallel.py`): `kv_heads` is then `tp`
  here, and the K and V projections count that many times in the weights per chip.
- **Pages.** `max_pages = floor((hbm - weights - reserve) / (page_size * kv_bytes_per_token / tp))`,
  where `reserve = reserve_fraction * hbm` is left for activations, logits and XLA's compile
  workspace.
- **Sequences.** A sequence of `prompt + new` tokens needs `ceil((prompt + new) / page_size)` pages in a
  layer of full attention, and in a sliding-window layer (Gemma 2 and 3, Mistral) only its window's pages and
  one more (`engine/kv/kv_groups.py`, engine.kv_groups auto); `max_seqs` is how many fit, rounded down to a
  power of two (the runner pads steps to power-of-two buckets) and capped at `max_seqs_cap`.
- **Throughput bound.** A decode step reads every weight on the chip once plus the KV of every live
  sequence (on average `prompt + new / 2` tokens each, a sliding layer's window at most), so
  `tokens/s <= max_seqs / ((weights + max_seqs * avg_len * kv_per_token) / hbm_bandwidth)` per
  engine, times `chips / tp` engines per slice. Real decoding is slower (compute, collectives,
  host round trips); the bound says which knob matters.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from engine import (DTYPE_BYTES, GiB, KVGroups, ModelConfig, count_params, kv_bytes_per_token, kv_page_bytes,
                    pages_for, sharded_config, tensor_parallel_error)


@dataclass(frozen=True)
class Chip:
    """One accelerator chip's memory and bandwidth, as its vendor documents them."""

    name: str
    hbm_gib: float
    """HBM capacity per chip in GiB (2**30 bytes)."""
    hbm_gb_per_s: float
    """HBM bandwidth per chip in GB/s (1e9 bytes per second)."""
    peak_bf16_tflops: float
    """Peak bf16 matmul throughput per chip in TFLOP/s (for the compute figure only)."""
    max_chips_per_host: int = 4
    """Chips one host holds at most: a slice of up to this many chips is one host; a bigger one is hosts of
    `multi_host_chips` chips each."""
    multi_host_chips: int = 4

    def chips_per_host(self, chips: int) -> int:
        """Chips of one host of a `chips`-chip slice (`pagefleet size --chips-per-host` overrides)."""
        return chips if chips <= self.max_chips_per_host else self.multi_host_chips


# Google Cloud TPU documentation, system architecture pages (cloud.google.com/tpu/docs/<chip>):
#   v5p: "HBM capacity per chip (GiB) 95", "HBM bandwidth per chip (GBps) 2765", 459 bf16 TFLOPs.
#   v6e: "HBM capacity per chip 32 GB", "HBM bandwidth per chip 1638 GBps", 918 bf16 TFLOPs
#        (32 GB is 29.8 GiB; we take the documented GB figure, the conservative reading).
#   v5e: "HBM2 capacity and bandwidth 16 GB, 819 GBps", 197 bf16 TFLOPs.
#   v4:  "HBM2 capacity and bandwidth 32 GiB, 1200 GBps", 275 bf16 TFLOPs.
#   Hosts: a v5p or v4 host has 4 chips; v5e and v6e slices of up to 8 chips are one host, bigger ones hosts of 4.
# NVIDIA datasheets (SXM): H100 "GPU Memory 80GB", "GPU Memory Bandwidth 3.35TB/s", H200 "141GB", "4.8TB/s";
#   BF16 Tensor Core 1,979 TFLOPS with sparsity for both, 989 dense (taken here). 8 GPUs a node (HGX).
CHIPS: dict[str, Chip] = {
    "v5p": Chip("v5p", hbm_gib=95.0, hbm_gb_per_s=2765.0, peak_bf16_tflops=459.0),
    "v6e": Chip("v6e", hbm_gib=32e9 / GiB, hbm_gb_per_s=1638.0, peak_bf16_tflops=918.0, max_chips_per_host=8),
    "v5e": Chip("v5e", hbm_gib=16e9 / GiB, hbm_gb_per_s=819.0, peak_bf16_tflops=197.0, max_chips_per_host=8),
    "v4": Chip("v4", hbm_gib=32.0, hbm_gb_per_s=1200.0, peak_bf16_tflops=275.0),
    "h100": Chip("h100", hbm_gib=80e9 / GiB, hbm_gb_per_s=3350.0, peak_bf16_tflops=989.0, max_chips_per_host=8,
                 multi_host_chips=8),
    "h200": Chip("h200", hbm_gib=141e9 / GiB, hbm_gb_per_s=4800.0, peak_bf16_tflops=989.0, max_chips_per_host=8,
                 multi_host_chips=8),
}


class SizingError(ValueError):
    """The model cannot be sized as asked; the message names the flag or file to change."""


def activation_bytes_per_chip(cfg: ModelConfig, tokens: int, seqs: int, tp: int) -> int:
    """An upper estimate of one step's live activations on a chip, in bytes: one layer's at a time (the
    layers are scanned), every tensor counted in float32 (norms and RoPE upcast) and held at once: the
    residual stream and three of its temporaries, q/k/v and the attention output (sharded over tp), gate,
    up and their product (sharded), for `tokens` tokens; plus the float32 logits of `seqs` rows and as
    much again three times over for the sampler (probabilities, the top-p sort and its indices)."""
    hidden, heads = cfg.hidden_size, (2 * cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    per_token = 4 * (4 * hidden + heads // tp + 3 * cfg.intermediate_size // tp)
    return tokens * per_token + 4 * seqs * cfg.vocab_size * 4


def check_tp(cfg: ModelConfig, tp: int) -> None:
    """The engine's rule for a tensor-parallel width (`engine.models.tensor_parallel`), as a SizingError naming --tp."""
    error = tensor_parallel_error(cfg, tp)
    if error is not None:
        raise SizingError(f"{error}; choose --tp (cluster.mesh.model) accordingly")


def largest_pow2_at_most(n: int) -> int:
    return 1 << (n.bit_length() - 1) if n >= 1 else 0


@dataclass(frozen=True)
class SizeReport:
    """What fits on one tensor-parallel group of chips, and the engine capacities that follow."""

    model: str
    chip: str | None
    dtype: str
    tp: int
    chips_per_slice: int
    engines_per_slice: int
    """Tensor-parallel groups per slice (chips / tp); the rest of the slice is data parallel."""
    hbm_bytes_per_chip: int
    hbm_gb_per_s: float
    reserve_fraction: float
    reserve_bytes_per_chip: int
    num_params: int
    replicated_params: int
    sharded_params: int
    weight_bytes_per_chip: int
    kv_bytes_per_token: int
    kv_bytes_per_token_per_chip: int
    page_size: int
    kv_bytes_per_page_per_chip: int
    kv_budget_bytes_per_chip: int
    max_pages: int
    prompt_tokens: int
    new_tokens: int
    pages_per_seq: int
    """Pages of every layer a sequence of the workload would hold in one table."""
    held_pages_per_seq: float
    """Pages' worth it holds with the layer groups (a sliding-window layer holds its window's): `pages_per_seq`
    for a model without a sliding window."""
    seqs_that_fit: int
    max_seqs_cap: int
    max_seqs: int
    max_seqs_in_prefill: int
    max_prefill_size: int
    max_seq_len: int
    decode_step_s: float
    """Memory-bound time of one decode step: all weights on a chip plus the KV of `max_seqs`
    sequences at their average length, read once at `hbm_gb_per_s`."""
    decode_tokens_per_s_per_engine: float
    decode_tokens_per_s_per_slice: float
    decode_compute_s: float | None
    """Matmul time of one decode step at the chip's peak (2 FLOPs per parameter per token)."""

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    def format(self) -> str:
        gib = lambda b: f"{b / GiB:,.2f} GiB"  # noqa: E731
        chip = f"{self.chip} " if self.chip else ""
        lines = [
            f"model: {self.model} ({self.dtype})",
            f"slice: {self.chips_per_slice} {chip}chips, {gib(self.hbm_bytes_per_chip)} HBM and "
            f"{self.hbm_gb_per_s:,.0f} GB/s each; tensor parallel {self.tp} -> {self.engines_per_slice} engine(s) per slice",
            f"parameters: {self.num_params:,} ({self.sharded_params:,} sharded over tp, "
            f"{self.replicated_params:,} replicated: embeddings, lm_head, norms)",
            f"weights per chip: {gib(self.weight_bytes_per_chip)}",
            f"KV per token: {self.kv_bytes_per_token:,} bytes ({self.kv_bytes_per_token / 1024:,.0f} KiB); "
            f"per chip: {self.kv_bytes_per_token_per_chip:,} bytes",
            f"reserve for activations and compile workspace: {gib(self.reserve_bytes_per_chip)} "
            f"({self.reserve_fraction:.0%} of HBM, --reserve-fraction)",
            f"KV budget per chip: {gib(self.kv_budget_bytes_per_chip)} = "
            f"{self.max_pages:,} pages of {self.page_size} tokens ({self.kv_bytes_per_page_per_chip:,} bytes per page per chip)",
            f"workload: {self.prompt_tokens} prompt + {self.new_tokens} new tokens = {self.pages_per_seq} pages per sequence"
            + (f" ({self.held_pages_per_seq:,.1f} held: its sliding-window layers keep their window's)"
               if self.held_pages_per_seq < self.pages_per_seq else "") + f"; {self.seqs_that_fit:,} sequences fit",
            "suggested engine capacities (per engine):",
            f"  engine.max_pages: {self.max_pages}",
            f"  engine.max_seqs: {self.max_seqs}   (power of two, capped at --max-seqs-cap {self.max_seqs_cap})",
            f"  engine.max_seqs_in_prefill: {self.max_seqs_in_prefill}",
            f"  engine.max_prefill_size: {self.max_prefill_size}",
            f"  engine.max_seq_len: {self.max_seq_len}",
            f"decode bound from HBM bandwidth: {self.decode_step_s * 1e3:,.2f} ms per step -> "
            f"{self.decode_tokens_per_s_per_engine:,.0f} tokens/s per engine, "
            f"{self.decode_tokens_per_s_per_slice:,.0f} tokens/s per slice",
        ]
        if self.decode_compute_s is not None:
            lines.append(f"  (matmuls at peak bf16 take {self.decode_compute_s * 1e3:,.2f} ms per step; "
                         f"{'memory' if self.decode_step_s >= self.decode_compute_s else 'compute'} bound)")
        return "\n".join(lines)


def read_model_config(path: str | Path) -> tuple[ModelConfig, str]:
    """config.json from a file or a checkpoint directory; returns the config and a display name."""
    p = Path(path)
    file = p / "config.json" if p.is_dir() else p
    if not file.is_file():
        raise SizingError(f"{file} not found: pass --model a checkpoint directory holding config.json, "
                          "or the config.json file itself (no weights are needed)")
    try:
        hf = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise SizingError(f"{file} is not valid JSON ({e}); pass the model's Hugging Face config.json") from None
    name = hf.get("_name_or_path") or file.parent.name
    return ModelConfig.from_hf(hf), str(name)


def size(cfg: ModelConfig, *, hbm_gib: float, hbm_gb_per_s: float, tp: int = 1, chips_per_slice: int | None = None,
         dtype: str = "bfloat16", prompt_tokens: int, new_tokens: int, page_size: int = 16,
         reserve_fraction: float = 0.15, max_seqs_cap: int = 256, peak_tflops: float | None = None,
         model_name: str = "model", chip: str | None = None) -> SizeReport:
    """Size one engine (a tensor-parallel group of `tp` chips) for sequences of prompt + new tokens."""
    if dtype not in DTYPE_BYTES:
        raise SizingError(f"--dtype {dtype!r} is not one of {', '.join(DTYPE_BYTES)}")
    check_tp(cfg, tp)
    chips_per_slice = tp if chips_per_slice is None else chips_per_slice
    if chips_per_slice < tp or chips_per_slice % tp:
        raise SizingError(f"--chips {chips_per_slice} is not a multiple of --tp {tp}: each slice runs chips / tp engines")
    if not 0 <= reserve_fraction < 1:
        raise SizingError(f"--reserve-fraction must be in [0, 1), got {reserve_fraction}")
    for flag, value in (("--prompt-tokens", prompt_tokens), ("--new-tokens", new_tokens), ("--page-size", page_size),
                        ("--max-seqs-cap", max_seqs_cap)):
        if value < 1:
            raise SizingError(f"{flag} must be at least 1, got {value}")
    if hbm_gib <= 0 or hbm_gb_per_s <= 0:
        raise SizingError("--hbm-gib and --hbm-gb-per-s must be positive (or pass --chip, one of v5p, v6e, v5e, v4, h100, h200)")
    seq_len = prompt_tokens + new_tokens
    if cfg.max_position_embeddings is not None and seq_len > cfg.max_position_embeddings:
        raise SizingError(f"{prompt_tokens} + {new_tokens} tokens exceed the model's context of "
                          f"{cfg.max_position_embeddings} tokens (max_position_embeddings); shorten the workload")

    nbytes = DTYPE_BYTES[dtype]
    params = count_params(cfg)
    held = sharded_config(cfg, tp)  # as the engine holds it: KV heads replicated when tp exceeds them
    hbm = int(hbm_gib * GiB)
    reserve = int(hbm * reserve_fraction)
    weights = count_params(held).per_chip(tp) * nbytes
    budget = hbm - reserve - weights
    kv_token = kv_bytes_per_token(held, nbytes)
    kv_token_chip = kv_token // tp
    page_bytes = kv_page_bytes(held, nbytes, page_size, tp)
    pages_per_seq = pages_for(seq_len, page_size)
    if budget < pages_per_seq * page_bytes:
        raise SizingError(
            f"weights take {weights / GiB:.2f} GiB per chip and the reserve {reserve / GiB:.2f} GiB of "
            f"{hbm / GiB:.2f} GiB HBM, leaving no room for one sequence's KV ({pages_per_seq} pages); "
            "raise --tp (cluster.mesh.model), use a chip with more HBM, or lower --reserve-fraction")
    max_pages = budget // page_bytes
    groups = KVGroups.for_engine(cfg.layer_windows(), "auto", 0)  # engine.kv_groups' default, no host pool
    fit = groups.seqs_that_fit(max_pages, seq_len, page_size)
    max_seqs = largest_pow2_at_most(min(fit, max_seqs_cap))
    # A step holds at least one whole prompt (up to 4,096 tokens): fewer, longer steps fill the MXUs;
    # the step's activations are what the reserve is for.
    max_prefill_size = min(4096, max(512, 1 << (prompt_tokens - 1).bit_length()))
    # Prompts shorter than the longest share a step: admit at least 8 per step (or as many longest ones fit).
    max_seqs_in_prefill = min(max_seqs, max(8, max_prefill_size // prompt_tokens))

    avg_len = prompt_tokens + new_tokens / 2
    step_bytes = weights + max_seqs * groups.tokens_read(avg_len) * kv_token_chip
    step_s = step_bytes / (hbm_gb_per_s * 1e9)
    per_engine = max_seqs / step_s
    compute_s = None
    if peak_tflops:
        compute_s = 2 * count_params(held).per_chip(tp) * max_seqs / (peak_tflops * 1e12)
    return SizeReport(
        model=model_name, chip=chip, dtype=dtype, tp=tp, chips_per_slice=chips_per_slice,
        engines_per_slice=chips_per_slice // tp, hbm_bytes_per_chip=hbm, hbm_gb_per_s=hbm_gb_per_s,
        reserve_fraction=reserve_fraction, reserve_bytes_per_chip=reserve, num_params=params.total,
        replicated_params=params.replicated, sharded_params=params.sharded, weight_bytes_per_chip=weights,
        kv_bytes_per_token=kv_token, kv_bytes_per_token_per_chip=kv_token_chip, page_size=page_size,
        kv_bytes_per_page_per_chip=page_bytes, kv_budget_bytes_per_chip=budget, max_pages=max_pages,
        prompt_tokens=prompt_tokens, new_tokens=new_tokens, pages_per_seq=pages_per_seq,
        held_pages_per_seq=groups.seq_units(seq_len, page_size) / groups.num_groups, seqs_that_fit=fit,
        max_seqs_cap=max_seqs_cap, max_seqs=max_seqs, max_seqs_in_prefill=max_seqs_in_prefill,
        max_prefill_size=max_prefill_size, max_seq_len=seq_len, decode_step_s=step_s,
        decode_tokens_per_s_per_engine=per_engine,
        decode_tokens_per_s_per_slice=per_engine * (chips_per_slice // tp), decode_compute_s=compute_s,
    )

