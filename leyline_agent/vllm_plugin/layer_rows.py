"""One vLLM attention layer's cache rows on a worker: its facts, its layout, its write op.

For each attention layer (``static_forward_context``) the worker reads what vLLM declares
(``cache_facts``: the cache view's shape and strides, the layer's KV cache spec, the
backend's name and declared layouts, the engine's resolved ``KVCacheLayout``), plans the
candidate row layouts (``cache_layout.plan_layout``) and probes them with the layer's own
write op (``backend_write``: the backend impl's ``do_kv_cache_update``, as vLLM's forward
calls it) into a scratch cache (``paged_rows.probe_layout``). ``rope_band`` says how the cached
keys rotate: GQA families as transformers' (vLLM builds them neox-style, half-split), and
DeepSeek MLA's latent rows with the rope band after ``kv_lora_rank`` elements, interleaved
(vLLM's DeepSeek attention builds its rotary embedding with ``is_neox_style=False``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from leyline_agent.errors import RopeSpecError
from leyline_agent.families import is_mla
from leyline_agent.kernels import RopeSpec
from leyline_agent.kernels.paged_rows import BackendWrite, RowLayout, probe_layout
from leyline_agent.vllm_plugin.cache_layout import CacheFacts, plan_layout

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention
    from vllm.v1.kv_cache_interface import KVCacheSpec

    AttentionLayer = Attention | MLAAttention  # the layers that hold a KV cache

__all__ = [
    "GQA_MODEL_TYPES",
    "attention_layers",
    "backend_write",
    "cache_facts",
    "layer_layout",
    "rope_band",
]

# vLLM builds these with is_neox_style=True: the cached key's rotary band is half-split,
# as transformers' (RopeSpec cache_owner="transformers").
GQA_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})


def attention_layers(vllm_config: VllmConfig) -> list[tuple[torch.Tensor, AttentionLayer]]:
    """Every attention layer's ``[B, H, N, C]`` cache view (once per tensor) with its layer."""
    ctx = vllm_config.compilation_config.static_forward_context
    out, seen = [], set()
    for layer in ctx.values():
        kv = getattr(layer, "kv_cache", None)
        if not isinstance(kv, torch.Tensor) or kv.numel() == 0 or kv.dim() != 4:
            continue
        if kv.data_ptr() in seen:
            continue
        seen.add(kv.data_ptr())
        out.append((kv, layer))
    return out


def _packed(spec: KVCacheSpec) -> str | None:
    for name in ("num_head_slots", "state_content_bytes", "page_size_padded"):
        if getattr(spec, name, None) is not None:
            return f"{name}={getattr(spec, name)}"
    if getattr(spec, "tokens_per_state", 1) != 1:
        return f"tokens_per_state={spec.tokens_per_state}"
    return None


def cache_facts(layer: AttentionLayer, kv: torch.Tensor, vllm_config: VllmConfig) -> CacheFacts:
    from vllm.v1.kv_cache_layout import KVCacheLayout

    backend = layer.attn_backend
    spec = layer.get_kv_cache_spec(vllm_config)
    layout = vllm_config.cache_config.kv_cache_layout
    supported = backend.supported_kv_cache_layouts()
    quant = getattr(getattr(spec, "kv_quant_mode", None), "name", "NONE")
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    return CacheFacts(
        backend=backend.get_name(), mla=bool(backend.is_mla()),
        shape=tuple(kv.shape), strides=tuple(kv.stride()), dtype=str(kv.dtype),
        kv_cache_dtype=cache_dtype if quant == "NONE" else f"{cache_dtype} ({quant})",
        spec=type(spec).__name__, block_size=int(spec.block_size),
        num_kv_heads=int(spec.num_kv_heads), head_size=int(spec.head_size),
        head_size_v=int(spec.head_size_v), packed=_packed(spec), sparse=bool(backend.is_sparse()),
        layout=layout, layout_order=KVCacheLayout[layout].layer_view_order if layout else None,
        supported=None if supported is None else tuple(x.name for x in supported),
    )  # fmt: skip


def backend_write(layer: AttentionLayer, mla: bool) -> BackendWrite:
    """The layer's write op, called as vLLM's attention forward calls it."""
    impl = layer.impl
    if mla:
        rank = int(layer.kv_lora_rank)

        def write_mla(
            kv: torch.Tensor, slots: torch.Tensor, keys: torch.Tensor, _v: torch.Tensor
        ) -> None:
            impl.do_kv_cache_update(keys[:, 0, :rank].contiguous(), keys[:, :, rank:].contiguous(),
                                    kv, slots, layer.kv_cache_dtype, layer._k_scale)  # fmt: skip

        return write_mla

    def write(kv: torch.Tensor, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor):
        impl.do_kv_cache_update(layer, keys.contiguous(), values.contiguous(), kv, slots)

    return write


def layer_layout(layer: AttentionLayer, kv: torch.Tensor, vllm_config: VllmConfig) -> RowLayout:
    """The row layout of ``layer``'s cache ``kv``: planned from vLLM's declarations, kept
    only if the layer's own write op agrees (``UnsupportedLayoutError`` otherwise)."""
    facts = cache_facts(layer, kv, vllm_config)
    candidates = plan_layout(facts)
    return probe_layout(kv, candidates, backend_write(layer, facts.mla), facts.backend)


def rope_band(vllm_config: VllmConfig) -> tuple[RopeSpec, int]:
    """How the served model's cached keys rotate, and where the band starts in a row."""
    hf = vllm_config.model_config.hf_config
    if is_mla(hf.model_type):
        spec = RopeSpec.from_hf_config(hf, cache_owner="sglang")  # YaRN as vLLM: truncated
        if spec.rotary_dim != int(hf.qk_rope_head_dim):
            raise RopeSpecError(f"rotary_dim: {spec.rotary_dim} != qk_rope_head_dim")
        return spec.model_copy(update={"layout": "interleaved"}), int(hf.kv_lora_rank)
    if hf.model_type not in GQA_MODEL_TYPES:
        raise RopeSpecError(
            f"model_type: {hf.model_type!r}; the vLLM plugin splices "
            f"{sorted(GQA_MODEL_TYPES)} and MLA models"
        )
    return RopeSpec.from_hf_config(hf, cache_owner="transformers"), 0
