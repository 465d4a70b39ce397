"""The KV cache manager's configuration: the part of EngineConfig it and its parts read. No JAX here."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVCacheConfig:
    """The part of EngineConfig the KV cache manager reads (EngineConfig documents each key)."""

    page_size: int  # tokens per page
    max_pages: int  # device pages in the pool
    host_kv_pages: int  # host pool pages (swap and the prefix cache's host tier); 0: none
    prefix_caching: bool
    preemption: str  # recompute | swap | auto

    @classmethod
    def of(cls, config) -> "KVCacheConfig":
        """The sub-config of an EngineConfig (or anything with these attributes)."""
        return cls(config.page_size, config.max_pages, config.host_kv_pages, config.prefix_caching,
                   config.preemption)
