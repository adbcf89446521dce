"""SGLang's real radix cache, allocator and KV pools on CPU, filled by a Hugging Face model.

Tests of the SGLang plugin build ``RadixCache`` + ``TokenToKVPoolAllocator`` +
``MLATokenToKVPool`` / ``MHATokenToKVPool`` (SGLang 0.5.23, installed ``--no-deps``: they
import and run on CPU) and fill them the way SGLang's prefill would leave them after a
request: longest cached prefix reused (``match_prefix``), fresh slots allocated for the
rest, their KV rows written into the pool's per-layer buffers, the sequence inserted
with ``insert`` and duplicate slots freed (the pool's own ``set_kv_buffer`` needs SGLang's
published parallel config, so rows are indexed into its buffers directly). The KV rows come from a plain forward of the
model (``kv_reference.plain_kv``): SGLang's DeepSeek caches ``k_pe`` interleaved like
transformers' DeepseekV2, and Llama/Qwen keys half-split like transformers.

``snapshot`` captures everything a failed splice must leave bitwise unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["SGLangCache", "Snapshot", "build_cache", "evict_all", "prefill", "rows", "snapshot"]


@dataclass(slots=True)
class SGLangCache:
    tree: Any  # sglang RadixCache
    allocator: Any  # sglang TokenToKVPoolAllocator
    pool: Any  # sglang MLATokenToKVPool | MHATokenToKVPool
    config: Any  # the model's HF config
    kind: str  # "mla" | "mha"
    initial_free: int

    def target(self) -> Any:
        from leyline_agent.kernels import RopeSpec
        from leyline_agent.sglang_plugin.splice import SpliceTarget

        spec = RopeSpec.from_hf_config(self.config, cache_owner="sglang")
        return SpliceTarget(self.tree, self.allocator, self.pool, spec)


def build_cache(config: Any, size: int = 1024, dtype: torch.dtype = torch.float32) -> SGLangCache:
    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
    from sglang.srt.mem_cache.radix_cache import RadixCache

    common = dict(size=size, page_size=1, dtype=dtype, layer_num=config.num_hidden_layers)
    if config.model_type in ("deepseek_v2", "deepseek_v3"):
        kind = "mla"
        pool = MLATokenToKVPool(
            **common,
            kv_lora_rank=config.kv_lora_rank,
            qk_rope_head_dim=config.qk_rope_head_dim,
            device="cpu",
            enable_memory_saver=False,
        )
    else:
        kind = "mha"
        head_dim = (
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        pool = MHATokenToKVPool(
            **common,
            head_num=config.num_key_value_heads,
            head_dim=head_dim,
            device="cpu",
            enable_memory_saver=False,
        )
    allocator = TokenToKVPoolAllocator(size, dtype, "cpu", pool, need_sort=False)
    tree = RadixCache(
        CacheInitParams(
            disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=allocator, page_size=1
        )
    )
    return SGLangCache(tree, allocator, pool, config, kind, allocator.available_size())


def prefill(cache: SGLangCache, model: Any, token_ids: Sequence[int]) -> torch.Tensor:
    """Cache ``token_ids`` as SGLang's prefill + insert would; returns the path's slots."""
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams

    from leyline_agent.sglang_plugin.treeview import radix_key
    from leyline_agent.testing.kv_reference import plain_kv

    ids = [int(t) for t in token_ids]
    m = cache.tree.match_prefix(MatchPrefixParams(key=radix_key(ids)))
    cached = cache.tree.path_device_indices(m.last_device_node)[: m.device_prefix_len]
    n_new = len(ids) - m.device_prefix_len
    new = cache.allocator.alloc(n_new)
    if new is None:
        raise RuntimeError(f"test pool too small for {n_new} tokens")
    kv = plain_kv(model, ids)
    lo = m.device_prefix_len
    for layer, (k, v) in enumerate(kv):
        if cache.kind == "mla":  # k: latent [1,1,n,r], v: k_pe [1,1,n,rope] -> [n,1,r+rope]
            row = torch.cat([k[0, 0, lo:], v[0, 0, lo:]], dim=-1).unsqueeze(1)
            cache.pool.kv_buffer[layer][new] = row.to(cache.pool.dtype)
        else:  # [1,H,n,D] -> [n,H,D]
            cache.pool.k_buffer[layer][new] = k[0, :, lo:].transpose(0, 1).to(cache.pool.dtype)
            cache.pool.v_buffer[layer][new] = v[0, :, lo:].transpose(0, 1).to(cache.pool.dtype)
    slots = torch.cat([cached.to(torch.int64), new])
    res = cache.tree.insert(InsertParams(key=radix_key(ids), value=slots))
    dup = res.prefix_len - lo
    if dup > 0:
        cache.allocator.free(new[:dup])
    return slots


def rows(cache: SGLangCache, slots: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, copies of the rows of ``slots`` in transformers' split:
    MLA ``(latent [n, r], k_pe [n, rope])``, MHA ``(keys [H, n, D], values [H, n, D])``."""
    out = []
    idx = slots.to(torch.int64)
    if cache.kind == "mla":
        r = cache.pool.kv_lora_rank
        for buf in cache.pool.kv_buffer:
            row = buf.index_select(0, idx)[:, 0]
            out.append((row[:, :r].clone(), row[:, r:].clone()))
        return out
    for k, v in zip(cache.pool.k_buffer, cache.pool.v_buffer, strict=True):
        out.append(
            (
                k.index_select(0, idx).transpose(0, 1).clone(),
                v.index_select(0, idx).transpose(0, 1).clone(),
            )
        )
    return out


def evict_all(cache: SGLangCache) -> int:
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    total = cache.tree.total_size() + 1
    return cache.tree.evict(EvictParams(num_tokens=total)).num_tokens_evicted


@dataclass(slots=True)
class Snapshot:
    nodes: list[tuple]  # (depth, key tokens, slots, lock_ref) of every node, depth-first
    sizes: tuple[int, int]  # evictable, protected
    free: tuple[torch.Tensor, torch.Tensor]  # allocator free_pages, release_pages
    buffers: list[torch.Tensor]

    def assert_equal(self, other: Snapshot) -> None:
        assert self.nodes == other.nodes, "radix tree changed"
        assert self.sizes == other.sizes, f"tree sizes changed: {self.sizes} -> {other.sizes}"
        for a, b in zip(self.free, other.free, strict=True):
            assert torch.equal(a, b), "allocator free list changed"
        assert len(self.buffers) == len(other.buffers)
        for i, (a, b) in enumerate(zip(self.buffers, other.buffers, strict=True)):
            assert torch.equal(a, b), f"KV pool buffer {i} changed"


def snapshot(cache: SGLangCache) -> Snapshot:
    nodes: list[tuple] = []
    stack = [(cache.tree.root_node, 0)]
    while stack:
        node, depth = stack.pop()
        value = tuple(int(x) for x in node.value) if node.value is not None else None
        nodes.append((depth, tuple(node.key.token_ids), value, node.lock_ref))
        for child in sorted(node.children.values(), key=lambda c: tuple(c.key.token_ids)):
            stack.append((child, depth + 1))
    pool = cache.pool
    bufs = list(pool.kv_buffer) if cache.kind == "mla" else [*pool.k_buffer, *pool.v_buffer]
    return Snapshot(
        nodes=nodes,
        sizes=(cache.tree.evictable_size(), cache.tree.protected_size()),
        free=(cache.allocator.free_pages.clone(), cache.allocator.release_pages.clone()),
        buffers=[b.clone() for b in bufs],
    )
