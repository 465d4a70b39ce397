"""The KV cache manager's configuration: the part of EngineConfig it and its parts read. No JAX here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.kv.kv_groups import KVGroups


@dataclass(frozen=True)
class KVCacheConfig:
    """The part of EngineConfig the KV cache manager reads (EngineConfig documents each key)."""

    page_size: int  # tokens per page
    max_pages: int  # device pages in the pool
    host_kv_pages: int  # host pool pages (swap and the prefix cache's host tier); 0: none
    prefix_caching: bool
    preemption: str  # recompute | swap | auto
    groups: "KVGroups | None" = None  # the layers' page tables (engine/kv/kv_groups.py); None: one for every layer

    @classmethod
    def of(cls, config, groups: "KVGroups | None" = None) -> "KVCacheConfig":
        """The sub-config of an EngineConfig (or anything with these attributes), with the model's `groups`."""
        return cls(config.page_size, config.max_pages, config.host_kv_pages, config.prefix_caching,
                   config.preemption, groups)
