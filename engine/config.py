"""Engine and sampling configuration: frozen, typed, defaulted; composed only at the run config."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

from engine.sampling.structured_spec import Spec, spec_of


INT32_MAX = 2**31 - 1
"""The largest token count or token id a sampling setting may hold (they travel as int32)."""

GREEDY_BELOW = 1e-5
"""A sampling.temperature below this samples greedily (the limit of a temperature going to 0, and vLLM's threshold
for greedy, its _SAMPLING_EPS): logits divided by much less pass float32's range, where the draw would take the
first +inf rather than the most likely token. vLLM 0.32 itself raises a temperature in (0, 0.01) to 0.01."""

DEFAULT_MAX_SEQS_IN_PREFILL = 8
"""engine.max_seqs_in_prefill when it is not set (capped at engine.max_seqs)."""


DTYPES = ("bfloat16", "float32")
"""The parameter and activation dtypes the engine runs (`Engine(dtype=...)`, `model.dtype`)."""


@dataclass(frozen=True)
class EngineConfig:
    page_size: int = 16
    """Tokens per KV page."""
    max_pages: int = 1024
    """Pages in the KV pool (shared by every live sequence). A pool larger than the memory it goes in (the
    device's; on CPU the host's available memory) is refused when the engine starts, naming this key."""
    max_seqs: int = 32
    """Sequences decoded at once (slots)."""
    max_seqs_in_prefill: int | None = None
    """Sequences that may receive prompt tokens in one step; unset, min(8, max_seqs), so it follows a
    smaller max_seqs (an explicit value above max_seqs is an error)."""
    max_prefill_size: int = 512
    """Tokens (prompt chunks plus decode tokens) processed in one step."""
    kv_memory_gib: float | None = None
    """KV pool size in GiB for an engine sized for the machine (`pagefleet generate`): sets max_pages when
    engine.max_pages is not given. None: a share of the memory available on CPU, of the device's memory less
    the weights on an accelerator (engine/sizing/machine_sizing.py). `pagefleet run` refuses it: a run's capacities
    are explicit and identical on every host (engine.max_pages)."""
    max_seq_len: int | None = None
    """Longest sequence (prompt plus completion) in tokens; defaults to the model's context length."""
    reset_mode: Literal["logical", "physical"] = "logical"
    """`logical` drops page metadata only; `physical` also zeroes the KV pool."""
    cleanup_mode: Literal["none", "end", "incremental"] = "incremental"
    """When a finished sequence's pages are freed: at once, at the end of a call, or only at reset."""
    attn_pages_per_block: int = 8
    """KV pages per block of the blocked (online softmax) reference attention."""
    attn_queries_per_block: int = 16
    """Query rows per tile of the reference attention (a decoding sequence's one new token is a tile of its own).
    Every kind of step uses the same tiles and blocks, so a token's bits do not depend on the step it is in."""
    attn_tiles_per_group: int = 8
    """Query tiles the reference attention processes together; each group walks only as many KV blocks
    as its busiest tile needs (tiles are sorted by need), so smaller groups waste less on short tiles."""
    attention_impl: Literal["auto", "reference", "pallas_tpu", "cpu_kernel"] = "auto"
    """`auto` uses the Pallas TPU kernel on TPU, the native CPU kernel (built on first use with the machine's
    C++ compiler) for a float32 pool on CPU, and the blocked JAX reference otherwise (logged once)."""
    decode_steps: int = 4
    """Decode steps per device call when every running sequence is decoding; 1 turns multi-step decode off."""
    pipeline_decode: bool = True
    """Dispatch the next multi-step decode call (the same rows, continued on the device) before reading the
    current one, so that the host's work on each call's tokens overlaps the next call; only while no
    sequence waits for a slot (a row that stops would keep its slot one call longer). Same tokens either
    way; a row finished by a stop string runs one call more, its tokens discarded. False reads each call
    before dispatching the next."""
    prefix_caching: bool = True
    """Reuse the KV of full prompt pages across sequences with the same leading tokens (within a call and across
    calls and batches): a new sequence maps the cached pages of its prompt's leading full pages and computes
    only the rest. Cached pages nobody maps are reclaimed, least recently used first, only when pages run out.
    Samples are the same either way."""
    host_kv_pages: int = 0
    """Pages of a host-memory KV pool (the device pool's page layout, in host RAM) that preempted sequences'
    pages are swapped to under engine.preemption `swap` or `auto`, and, with engine.prefix_caching, that cached
    prefix pages the device reclaims spill to (a later prompt with that prefix pages them back in instead of
    recomputing them; swapped pages take precedence over spilled ones); 0 turns it off (preemption recomputes
    and reclaimed prefix pages are dropped, as without it). Each page takes as many bytes as a device page,
    taken only as the pool fills; a pool that would not fit in the host memory available when the engine starts
    is refused then, naming the most pages that fit (on a cluster, each slice checks its own hosts)."""
    preemption: Literal["recompute", "swap", "auto"] = "recompute"
    """What a sequence preempted for lack of pages keeps: `recompute` drops its pages and recomputes its tokens
    later; `swap` copies its pages to the host pool and back before its next step (nothing recomputed, the same
    samples), recomputing only when the host pool is full; `auto` swaps when the host pool has room unless a
    recompute is cheap: less than a page of the sequence's computed tokens is outside its prompt pages the
    prefix cache holds.
    Without a host pool (engine.host_kv_pages=0) `auto` recomputes and `swap` is an error."""
    kv_groups: Literal["auto", "off"] = "auto"
    """`auto`: each group of layers with one attention kind has its own page table, and a sliding-window layer's
    pages go back to the pool once every position in them has left the window (Gemma 2 and 3 hold a window's
    pages in their sliding layers, Mistral in every layer, instead of the whole sequence's); with
    engine.host_kv_pages > 0 a model with layers of two kinds keeps one table (the host pool copies pages of one
    table). `off`: one page table for every layer, each holding every position. Samples are the same either way.
    Models without a sliding window have one table either way."""
    debug_invariants: bool = False
    """Check page-allocator and sequence invariants after every step (slow; for debugging)."""

    def __post_init__(self) -> None:
        if self.max_seqs_in_prefill is None:  # a dependent default: resolved here, so every reader sees an int
            object.__setattr__(self, "max_seqs_in_prefill", min(DEFAULT_MAX_SEQS_IN_PREFILL, self.max_seqs))
        positive = ("page_size", "max_pages", "max_seqs", "max_seqs_in_prefill", "max_prefill_size",
                    "attn_pages_per_block", "attn_queries_per_block", "attn_tiles_per_group", "decode_steps")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"engine.{name} must be at least 1, got {getattr(self, name)}")
        if self.kv_memory_gib is not None and not self.kv_memory_gib > 0:
            raise ValueError(f"engine.kv_memory_gib must be positive, got {self.kv_memory_gib}")
        if self.host_kv_pages < 0:
            raise ValueError(f"engine.host_kv_pages must be at least 0, got {self.host_kv_pages}")
        if self.preemption not in ("recompute", "swap", "auto"):
            raise ValueError(f"engine.preemption must be recompute, swap or auto, got {self.preemption!r}")
        if self.kv_groups not in ("auto", "off"):
            raise ValueError(f"engine.kv_groups must be auto or off, got {self.kv_groups!r}")
        if self.preemption == "swap" and self.host_kv_pages == 0:
            raise ValueError("engine.preemption=swap needs a host pool: set engine.host_kv_pages > 0")
        if self.max_seqs_in_prefill > self.max_seqs:
            raise ValueError(
                f"engine.max_seqs_in_prefill ({self.max_seqs_in_prefill}) exceeds engine.max_seqs ({self.max_seqs})"
            )


@dataclass(frozen=True)
class SamplingConfig:
    max_new_tokens: int = 256
    """Most tokens generated per sample."""
    temperature: float = 0.0
    """0 means greedy; so does a temperature below 1e-5 (its limit; dividing logits by less can overflow float32)."""
    top_p: float = 1.0
    """Nucleus sampling mass; 1.0 is off."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 is off."""
    min_p: float = 0.0
    """Drop tokens whose probability (after temperature) is below min_p times the most likely token's; 0 is off,
    and a greedy sample (temperature 0) is unchanged by it."""
    repetition_penalty: float = 1.0
    """Every token already in the prompt or the completion has its logit divided by this when positive and
    multiplied by it when negative (transformers' and vLLM's repetition_penalty, greedy included); 1 is off."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token the completion already holds (OpenAI's and vLLM's); 0 is off."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time the completion already holds it; 0 is off."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that end a sample as EOS does (kept in token_ids, finish_reason `stop`), besides the EOS ids."""
    min_tokens: int = 0
    """Fewest tokens generated before the sample may end at a stop id or a stop string (vLLM's min_tokens): until
    then the EOS ids and sampling.stop_token_ids are not drawn (unless a structured output allows nothing else) and
    no stop string may end; logprobs stay the model's, as vLLM reports them. 0 is off; at most max_new_tokens."""
    ignore_eos: bool = False
    """The EOS ids do not end the sample (vLLM's ignore_eos): it runs to max_new_tokens, a stop string or one of
    sampling.stop_token_ids. Not with a structured output (whose end is an EOS)."""
    n: int = 1
    """Samples per prompt."""
    seed: int = 0
    """Each sample's random stream derives from (seed, prompt_id, generation_index, position) alone."""
    stop: list[str] = field(default_factory=list)
    """Stop strings (excluded from the completion); the EOS ids always stop (the tokenizer's, and the checkpoint's
    generation_config.json eos_token_id, else config.json's)."""
    logprobs: bool = False
    """Return the chosen tokens' log-probabilities."""
    prompt_logprobs: int | None = None
    """K: return, for every prompt token after the first, its log-probability under the model and the K most
    likely tokens at its position (vLLM's prompt_logprobs); None is off. Prompt tokens are then all computed
    (none is read from the prefix cache), sampled and scored rows alike."""
    json_schema: dict[str, Any] | str | None = None
    """Structured output: every completion is JSON valid under this JSON Schema (a mapping in YAML, JSON text on the
    command line), or ends with finish_reason `length`. One at most of json_schema, regex, choice, grammar."""
    regex: str | None = None
    """Structured output: every completion matches this regular expression (Rust regex syntax, whole text)."""
    choice: list[str] | None = None
    """Structured output: every completion is one of these strings."""
    grammar: str | None = None
    """Structured output: every completion is a sentence of this grammar (llguidance's Lark syntax)."""

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            if not math.isfinite(getattr(self, name)):  # NaN would run greedy, Infinity sample uniformly: silently
                raise ValueError(f"sampling.{name} must be a finite number, got {getattr(self, name)}")
        for name in ("max_new_tokens", "top_k"):
            if getattr(self, name) > INT32_MAX:  # token counts travel as int32 (batch files, device arrays)
                raise ValueError(f"sampling.{name} must be at most {INT32_MAX:,}, got {getattr(self, name)}")
        if self.max_new_tokens < 1:
            raise ValueError(f"sampling.max_new_tokens must be at least 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"sampling.temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"sampling.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"sampling.top_k must be >= 0, got {self.top_k}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= INT32_MAX:
            raise ValueError(f"sampling.prompt_logprobs must be a count >= 0 (or null), got {self.prompt_logprobs}")
        if self.n < 1:
            raise ValueError(f"sampling.n must be at least 1, got {self.n}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"sampling.min_p must be in [0, 1], got {self.min_p}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"sampling.repetition_penalty must be positive, got {self.repetition_penalty}")
        spec_of(self.json_schema, self.regex, self.choice, self.grammar)  # one at most, each of its type
        if not 0 <= self.min_tokens <= self.max_new_tokens:
            raise ValueError(f"sampling.min_tokens must be in [0, max_new_tokens = {self.max_new_tokens}], "
                             f"got {self.min_tokens}")
        if self.ignore_eos and self.structured is not None:
            raise ValueError("sampling.ignore_eos cannot be used with a structured output (json_schema, regex, choice "
                             "or grammar): the format ends at an EOS id")
        if any(t < 0 or t > INT32_MAX for t in self.stop_token_ids):
            raise ValueError(f"sampling.stop_token_ids must be token ids (0 to {INT32_MAX:,}), got {self.stop_token_ids}")

    @property
    def draw_temperature(self) -> float:
        """The temperature the draw divides by: 0 (greedy) below GREEDY_BELOW."""
        return 0.0 if self.temperature < GREEDY_BELOW else self.temperature

    @property
    def structured(self) -> Spec | None:
        """The sample's structured output as (kind, text), or None (engine/sampling/structured_spec.py)."""
        return spec_of(self.json_schema, self.regex, self.choice, self.grammar)

    @property
    def penalizes(self) -> bool:
        """Whether a penalty changes this sample's logits (the step program then counts tokens)."""
        return penalizes(self.repetition_penalty, self.presence_penalty, self.frequency_penalty)


def penalizes(repetition_penalty: float, presence_penalty: float, frequency_penalty: float) -> bool:
    """Whether these penalties change any logit (each is off at its default)."""
    return repetition_penalty != 1.0 or presence_penalty != 0.0 or frequency_penalty != 0.0


SamplingParams = SamplingConfig
"""The public name of the sampling settings (`engine.SamplingParams`); the run config calls them `sampling`."""
