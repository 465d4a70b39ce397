"""The model runner's configuration: the part of EngineConfig it reads. No JAX here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.kv.kv_cache_config import KVCacheConfig

if TYPE_CHECKING:
    from engine.kv.kv_groups import KVGroups


@dataclass(frozen=True)
class RunnerConfig:
    """The part of EngineConfig the model runner reads (EngineConfig documents each key)."""

    max_seqs: int  # rows of a step: the sequence bucket's cap
    decode_steps: int  # decode steps a multi-step call may take
    attention_impl: str
    attn_pages_per_block: int
    attn_queries_per_block: int
    attn_tiles_per_group: int
    kv: KVCacheConfig  # the pool's pages, page size and host pages

    @property
    def page_size(self) -> int:
        return self.kv.page_size

    @property
    def max_pages(self) -> int:
        return self.kv.max_pages

    @classmethod
    def of(cls, config, groups: "KVGroups | None" = None) -> "RunnerConfig":
        """The sub-config of an EngineConfig (or anything with these attributes), with the model's KV `groups`."""
        return cls(config.max_seqs, config.decode_steps, config.attention_impl, config.attn_pages_per_block,
                   config.attn_queries_per_block, config.attn_tiles_per_group, KVCacheConfig.of(config, groups))
