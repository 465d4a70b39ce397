"""The KV cache manager's configuration: the part of EngineConfig it and its parts read. No JAX here."""

from __future__ import annotations

from dataclasses import dataclass

from engine.kv.kv_groups import KVGroups


@dataclass(frozen=True)
class KVCacheConfig:
    """The part of EngineConfig the KV cache manager reads (EngineConfig documents each key)."""

    page_size: int  # tokens per page
    max_pages: int  # device pages in the pool
    host_kv_pages: int  # host pool pages (swap and the prefix cache's host tier); 0: none
    prefix_caching: bool
    preemption: str  # recompute | swap | auto
    groups: "KVGroups | None" = None  # the pool's layer groups (engine/kv/kv_groups.py); None: one table, no window

    @property
    def layer_groups(self) -> KVGroups:
        """The groups the host side reads (their windows and count): `groups`, or one group without a window."""
        return self.groups or KVGroups.single(1)

    @classmethod
    def of(cls, config, groups: KVGroups | None = None) -> "KVCacheConfig":
        """The sub-config of an EngineConfig (or anything with these attributes), with the model's layer groups."""
        return cls(config.page_size, config.max_pages, config.host_kv_pages, config.prefix_caching,
                   config.preemption, groups)
