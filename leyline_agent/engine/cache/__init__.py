"""The engine's KV cache, in three levels (as SGLang's ``mem_cache``):

- ``radix.RadixCache``: token-id prefixes -> slot indices (ints), with provenance tags;
  no tensors.
- ``allocator.SlotAllocator``: which slot indices are free.
- ``kv_pool.KVPool``: the bytes, ``[layers, heads, slots, dim]`` keys and values (torch).

``prefix_cache.PrefixCache`` puts the tree, the allocator and the token budget behind one
API (``match / hold / release / insert / pin / arrive / evict``); ``pins`` keeps a
directive's result for its session's next request. Nothing outside this package touches the
tree's internals.
"""
