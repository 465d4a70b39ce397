"""The KV cache: the manager that owns every page (allocator, prefix cache, host tier, swap, staging) and the device and host pools."""
