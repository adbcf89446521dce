"""Which row layouts one vLLM 0.32 attention cache can have, from what vLLM declares (pure).

vLLM 0.32 views every attention layer's cache as the logical ``[B, H, N, C]`` (blocks,
head slots, rows per block, content; ``vllm/v1/kv_cache_interface.create_kv_cache_views``),
with the physical order of those axes given by the engine's resolved ``KVCacheLayout``
(``layer_view_order``, per vLLM's layout RFC). The content ``C`` is the spec's ``head_size +
head_size_v`` elements: key then value for FlashAttention, FlashInfer and Triton attention
(their write op ``reshape_and_cache_flash`` stores ``kv.transpose(1, 2).split(head_size)``),
the latent ``[kv_lora_rank | rope band]`` with no value for the MLA backends
(``concat_and_cache_mla``, one head slot). The CPU backend reinterprets each (block, head)
chunk as ``[2N, head_size]`` and its op may store keys transposed inside it.

:func:`plan_layout` checks the facts a worker reads from its cache (the tensor's shape and
strides, the layer's spec, the backend's declared layouts, the resolved layout) and answers
the candidate ``RowLayout`` s that such a cache can have; ``kernels.paged_rows.probe_layout`` then
keeps the one that explains where the backend's own write op puts known rows. A cache
whose declaration the plugin cannot address is refused by the backend's name and the
reason (``UnsupportedLayoutError``, a 503 naming ``kv_cache_layout``). No tensor is read here.
"""

from __future__ import annotations

from dataclasses import dataclass

from leyline_agent.kernels.paged_rows import RowLayout, UnsupportedLayoutError

__all__ = ["CacheFacts", "physical_order", "plan_layout"]

FLOAT_DTYPES = frozenset({"torch.float32", "torch.bfloat16", "torch.float16"})
PLAIN_SPECS = frozenset({"FullAttentionSpec", "MLAAttentionSpec"})


@dataclass(slots=True, frozen=True)
class CacheFacts:
    """What a worker reads about one layer's cache: the tensor, its spec, its backend."""

    backend: str  # the backend's get_name(): used in messages only
    mla: bool
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: str  # str(torch dtype)
    kv_cache_dtype: str  # the cache config's ("auto" or a quantized type)
    spec: str  # type name of the layer's KV cache spec
    block_size: int
    num_kv_heads: int
    head_size: int
    head_size_v: int
    packed: str | None = None  # why the spec's pages are not dense rows, if they are not
    sparse: bool = False
    layout: str | None = None  # the resolved KVCacheLayout's name
    layout_order: tuple[int, ...] | None = None  # its layer_view_order
    supported: tuple[str, ...] | None = None  # the backend's declared layouts; None: any


def physical_order(shape: tuple[int, ...], strides: tuple[int, ...]) -> tuple[int, ...]:
    """Logical axes from outermost to innermost in memory, axes of size 1 left out (their
    stride addresses nothing)."""
    axes = [i for i, n in enumerate(shape) if n > 1]
    return tuple(sorted(axes, key=lambda i: (-strides[i], i)))


def plan_layout(f: CacheFacts) -> tuple[RowLayout, ...]:
    """The row layouts a cache with these facts can have, most likely first; raises
    :class:`UnsupportedLayoutError` naming the backend and the reason."""

    def refuse(reason: str) -> UnsupportedLayoutError:
        return UnsupportedLayoutError(f"kv_cache_layout: backend {f.backend}: {reason}")

    if f.sparse:
        raise refuse("sparse MLA caches keep a subset of rows per step")
    if f.spec not in PLAIN_SPECS:
        raise refuse(f"{f.spec} caches are not plain attention rows")
    if f.kv_cache_dtype != "auto":
        raise refuse(f"kv_cache_dtype {f.kv_cache_dtype}: quantized rows cannot be rotated")
    if f.packed:
        raise refuse(f"packed pages ({f.packed})")
    if f.dtype not in FLOAT_DTYPES:
        raise refuse(f"dtype {f.dtype}: the rotation takes {sorted(FLOAT_DTYPES)}")
    width = f.head_size + f.head_size_v
    want = (f.num_kv_heads, f.block_size, width)
    if len(f.shape) != 4 or tuple(f.shape[1:]) != want:
        raise refuse(f"cache shape {list(f.shape)} is not the declared [B, {', '.join(map(str, want))}]")  # fmt: skip
    if f.mla and (f.head_size_v != 0 or f.num_kv_heads != 1):
        raise refuse("an MLA cache holds one latent row per token and no value")
    if f.layout is None or f.layout_order is None:
        raise refuse("the engine has not resolved a KV cache layout")
    if f.supported is not None and f.layout not in f.supported:
        raise refuse(f"the resolved layout {f.layout} is not one it declares {list(f.supported)}")
    if width > 1 and f.strides[3] != 1:
        raise refuse(f"the content axis has stride {f.strides[3]}, not 1")
    got = physical_order(f.shape, f.strides)
    declared = tuple(i for i in f.layout_order if f.shape[i] > 1)
    if got != declared:
        raise refuse(
            f"the cache's stride order {list(got)} (strides {list(f.strides)}) is not the "
            f"resolved layout {f.layout}'s {list(declared)}"
        )
    paged = RowLayout("paged", f.head_size, f.head_size_v)
    if f.mla or f.head_size != f.head_size_v or got != tuple(i for i in (0, 1, 2, 3) if f.shape[i] > 1):  # fmt: skip
        return (paged,)
    # a head-major cache whose (block, head) chunks are dense may be written chunk-wise
    return (paged, RowLayout("chunk", f.head_size, f.head_size_v, True),
            RowLayout("chunk", f.head_size, f.head_size_v, False))  # fmt: skip
