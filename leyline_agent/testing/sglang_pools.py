"""SGLang's real radix cache, allocator and KV pools on CPU, filled by a Hugging Face model.

Tests of the SGLang plugin build ``RadixCache`` + ``TokenToKVPoolAllocator`` +
``MLATokenToKVPool`` / ``MHATokenToKVPool`` (SGLang 0.5.23, installed ``--no-deps``: they
import and run on CPU) and fill them the way SGLang's prefill would leave them after a
request: longest cached prefix reused (``match_prefix``, in the request's radix namespace
``extra_key``), fresh slots allocated for the rest, their KV rows written into the pool's
per-layer buffers, the sequence inserted with ``insert`` and duplicate slots freed (the
pool's own ``set_kv_buffer`` needs SGLang's published parallel config, so rows are indexed
into its buffers directly). As in SGLang, the new rows are computed by a forward of the
model over the cached prefix's rows as the pool holds them (spliced ones included),
through transformers' own cache: SGLang's DeepSeek caches ``k_pe`` interleaved like
transformers' DeepseekV2, and Llama/Qwen keys half-split like transformers.

``snapshot`` captures everything a failed splice must leave bitwise unchanged;
``held_slots`` + the allocator's free size must always add up to the pool's size.

``LoopbackEngine`` stands in for ``sglang.Engine`` under ``SGLangRuntime``: its requests do
what the scheduler does with one (the plugin's routing hook picks the radix namespace, then
``prefill``), and its RPC socket (``send_to_rpc``, SGLang's own IPC encoding) reaches
``handle_rpc``: what ``Scheduler.handle_rpc_request`` does (call the method the plugin
installs on a stand-in scheduler holding the real cache; a failure becomes
``RpcReqOutput(success=False, message)``), wrapped in the plugin's hook on it, as SGLang
applies it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

__all__ = [
    "LoopbackEngine",
    "SGLangCache",
    "Snapshot",
    "build_cache",
    "evict_all",
    "held_slots",
    "match",
    "prefill",
    "rows",
    "snapshot",
]


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


def match(
    cache: SGLangCache, token_ids: Sequence[int], extra_key: str | None = None
) -> tuple[int, torch.Tensor]:
    """SGLang's own ``match_prefix`` in namespace ``extra_key``: (length, slots)."""
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams

    from leyline_agent.sglang_plugin.treeview import radix_key

    m = cache.tree.match_prefix(MatchPrefixParams(key=radix_key(list(token_ids), extra_key)))
    slots = cache.tree.path_device_indices(m.last_device_node)[: m.device_prefix_len]
    return m.device_prefix_len, slots.to(torch.int64)


def prefill(
    cache: SGLangCache, model: Any, token_ids: Sequence[int], extra_key: str | None = None
) -> torch.Tensor:
    """Cache ``token_ids`` in namespace ``extra_key`` as SGLang's prefill + insert would;
    returns the path's slots."""
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams

    from leyline_agent.sglang_plugin.treeview import radix_key

    ids = [int(t) for t in token_ids]
    lo, cached = match(cache, ids, extra_key)
    n_new = len(ids) - lo
    new = cache.allocator.alloc(n_new)
    if new is None:
        raise RuntimeError(f"test pool too small for {n_new} tokens")
    for layer, (k, v) in enumerate(_forward_over(cache, model, cached, ids[lo:])):
        if cache.kind == "mla":  # k: latent [1,1,n,r], v: k_pe [1,1,n,rope] -> [n,1,r+rope]
            row = torch.cat([k[0, 0], v[0, 0]], dim=-1).unsqueeze(1)
            cache.pool.kv_buffer[layer][new] = row.to(cache.pool.dtype)
        else:  # [1,H,n,D] -> [n,H,D]
            cache.pool.k_buffer[layer][new] = k[0].transpose(0, 1).to(cache.pool.dtype)
            cache.pool.v_buffer[layer][new] = v[0].transpose(0, 1).to(cache.pool.dtype)
    slots = torch.cat([cached, new])
    res = cache.tree.insert(InsertParams(key=radix_key(ids, extra_key), value=slots))
    dup = res.prefix_len - lo
    if dup > 0:
        cache.allocator.free(new[:dup])
    return slots


@torch.inference_mode()
def _forward_over(
    cache: SGLangCache, model: Any, cached: torch.Tensor, new_ids: list[int]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, transformers' (keys, values) ``[1, H, n, D]`` of ``new_ids`` forwarded
    over the pool rows ``cached`` (positions ``0..len(cached)-1``)."""
    from transformers import DynamicCache

    if not new_ids:
        return []
    lo = int(cached.numel())
    if lo:
        past = [
            (a[None, None], b[None, None]) if cache.kind == "mla" else (a[None], b[None])
            for a, b in rows(cache, cached)
        ]
        dtype = next(model.parameters()).dtype
        past_kv = DynamicCache(
            ddp_cache_data=[(k.to(dtype), v.to(dtype)) for k, v in past], config=model.config
        )
    else:
        past_kv = DynamicCache(config=model.config)
    model(input_ids=torch.tensor([new_ids]), past_key_values=past_kv, use_cache=True)
    return [
        (layer.keys[:, :, lo:].clone(), layer.values[:, :, lo:].clone()) for layer in past_kv.layers
    ]


def held_slots(cache: SGLangCache) -> int:
    """Slots the tree holds, in every namespace."""
    return int(cache.tree.total_size())


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
    nodes: list[tuple]  # (depth, extra key, key tokens, slots, lock_ref) of every node
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
        key = node.key
        nodes.append((depth, key.extra_key, tuple(key.token_ids), value, node.lock_ref))
        for child in sorted(node.children.values(), key=_node_order):
            stack.append((child, depth + 1))
    pool = cache.pool
    bufs = list(pool.kv_buffer) if cache.kind == "mla" else [*pool.k_buffer, *pool.v_buffer]
    return Snapshot(
        nodes=nodes,
        sizes=(cache.tree.evictable_size(), cache.tree.protected_size()),
        free=(cache.allocator.free_pages.clone(), cache.allocator.release_pages.clone()),
        buffers=[b.clone() for b in bufs],
    )


def _node_order(node: Any) -> tuple:
    return (node.key.extra_key or "", tuple(node.key.token_ids))


class _RpcSocket:
    """``Engine.send_to_rpc``: what is sent is decoded as the scheduler decodes it (SGLang's
    ``sock_send`` / ``sock_recv`` encodings), answered by ``handle``, and the reply is what
    the next receive returns."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle
        self.replies: list[Any] = []

    def send(self, data: bytes, flags: int = 0) -> None:
        from sglang.srt.managers.io_struct import msgpack_decode, msgpack_encode

        self.replies.append(msgpack_encode(self.handle(msgpack_decode(data))))

    def recv(self, flags: int = 0) -> bytes:
        return self.replies.pop(0)

    def send_pyobj(self, obj: Any, flags: int = 0, protocol: int = -1) -> None:
        self.replies.append(self.handle(obj))

    def recv_pyobj(self, flags: int = 0) -> Any:
        return self.replies.pop(0)


class LoopbackEngine:
    """``sglang.Engine``'s calls (``tokenizer_manager.generate_request`` on ``loop``, and
    ``collective_rpc``), landing on the real cache of one scheduler rank."""

    def __init__(self, model: Any, tokenizer: Any, size: int = 1024) -> None:
        from leyline_agent.sglang_plugin import scheduler_hook

        self.cache = build_cache(model.config, size=size)
        self.model = model
        self.loop = asyncio.new_event_loop()
        self.scheduler = SimpleNamespace(
            tree_cache=self.cache.tree,
            token_to_kv_pool_allocator=self.cache.allocator,
            model_config=SimpleNamespace(hf_config=model.config),
        )
        scheduler_hook.install(self.scheduler)
        self.tokenizer_manager = SimpleNamespace(
            tokenizer=tokenizer, generate_request=self._generate_request
        )
        self.send_to_rpc = _RpcSocket(self.handle_rpc)

    def generate(self, input_ids: Sequence[int], sampling_params: dict, extra_key=None) -> dict:
        """The scheduler's part: route the request (the plugin's hook), prefill it there.
        Answers which tree it went to and how much of it was cached."""
        from leyline_agent.sglang_plugin.routing import route_request

        assert sampling_params.get("max_new_tokens", 1) >= 1
        req = SimpleNamespace(input_ids=list(input_ids), extra_key=extra_key, cache_salt=None)
        route_request(self.cache.tree, req)
        cached = match(self.cache, req.input_ids, req.extra_key)[0]
        prefill(self.cache, self.model, input_ids, req.extra_key)
        return {"extra_key": req.extra_key, "cached_tokens": cached}

    async def _generate_request(self, obj: Any, request: Any = None):
        yield self.generate(obj.input_ids, obj.sampling_params, obj.extra_key)

    def handle_rpc(self, req: Any) -> Any:
        """``Scheduler.handle_rpc_request`` of one rank (no barrier), under the plugin's
        ``AROUND`` hook: an ``RpcReqOutput``."""
        from sglang.srt.managers.io_struct import RpcReqOutput

        from leyline_agent.sglang_plugin.scheduler_hook import around_rpc_request

        def handle(scheduler: Any, recv_req: Any) -> Any:
            try:
                getattr(scheduler, recv_req.method)(**(recv_req.parameters or {}))
            except Exception as e:
                return RpcReqOutput(success=False, message=str(e))
            return RpcReqOutput(success=True, message="")

        return around_rpc_request(handle, self.scheduler, req)

    def close(self) -> None:
        self.loop.close()
