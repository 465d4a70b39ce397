"""pagefleet's JAX inference engine: a haliax decoder on a paged KV cache. Never imports orchestrator."""
