"""The KV pool, its page allocator, the per-slot page table and the prefix caches."""
