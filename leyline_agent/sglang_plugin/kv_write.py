"""The bytes of a splice: write the tail's new slots in SGLang's KV pools.

MLA (``MLATokenToKVPool``): one row per slot, ``[latent (kv_lora_rank) | k_pe (rope dim)]``.
The latent is copied, the ``k_pe`` band rotated by ``delta`` (``rotate_band`` with
``band_offset = kv_lora_rank``). MHA/GQA (``MHATokenToKVPool``, NHD layout): keys are
``[slot, head, head_dim]``; every head's rotary band is rotated, values are copied.
Always out of place (``dst`` are fresh slots, ``src`` stay as they are): the old path
may be shared with other sequences and stays valid. ``copy_rows`` copies whole rows
bitwise (a head taken from the plain tree into a session's namespace).
"""

from __future__ import annotations

from typing import Any

import torch

from leyline_agent.errors import RuntimeUnavailableError

__all__ = ["check_pool", "copy_rows", "pool_kind", "write_tail"]


def pool_kind(pool: Any) -> str:
    """``"mla"`` or ``"mha"``; anything else (hybrid, SWA, DSA, fp8-packed) is refused."""
    name = type(pool).__name__
    if hasattr(pool, "kv_buffer") and hasattr(pool, "kv_lora_rank"):
        if getattr(pool, "use_dsa", False):
            raise RuntimeUnavailableError(f"{name}: DSA (indexer) KV pools are not supported")
        return "mla"
    if hasattr(pool, "k_buffer") and hasattr(pool, "v_buffer") and pool.k_buffer is not None:
        if pool.k_buffer[0].dim() != 3:
            raise RuntimeUnavailableError(
                f"{name}: only the NHD [slot, head, head_dim] layout is supported "
                f"(got a {pool.k_buffer[0].dim()}-d key buffer)"
            )
        return "mha"
    raise RuntimeUnavailableError(f"{name}: KV pool type not supported by the Leyline splice")


def check_pool(pool: Any, spec: Any) -> str:
    """Validate that ``spec`` describes this pool's cached rotary band; return its kind."""
    kind = pool_kind(pool)
    name = type(pool).__name__
    if pool.store_dtype != pool.dtype:
        raise RuntimeUnavailableError(
            f"{name}: quantized KV cache ({pool.store_dtype}) is not supported by the splice"
        )
    if getattr(pool, "is_quantized_kv_cache", False) is True:
        raise RuntimeUnavailableError(f"{name}: quantized KV cache is not supported")
    if kind == "mla":
        if pool.qk_rope_head_dim != spec.rotary_dim:
            raise RuntimeUnavailableError(
                f"{name}: qk_rope_head_dim {pool.qk_rope_head_dim} != rotary_dim "
                f"{spec.rotary_dim} of the model's RoPE spec"
            )
    elif spec.rotary_dim > pool.head_dim:
        raise RuntimeUnavailableError(
            f"{name}: rotary_dim {spec.rotary_dim} > head_dim {pool.head_dim}"
        )
    return kind


def write_tail(pool: Any, spec: Any, src: torch.Tensor, dst: torch.Tensor, delta: int) -> None:
    """For every layer: slots ``dst[k]`` <- slots ``src[k]`` with the rotary band moved by
    ``delta`` positions. Reads ``src`` only; ``dst`` must be disjoint from ``src``."""
    from leyline_agent.kernels import rotate_band

    kind = pool_kind(pool)
    if src.numel() == 0:
        return
    buffers = pool.kv_buffer if kind == "mla" else pool.k_buffer
    device = buffers[0].device
    src = src.to(device=device, dtype=torch.int64)
    dst = dst.to(device=device, dtype=torch.int64)
    if kind == "mla":
        for buf in pool.kv_buffer:  # [rows, 1, kv_lora_rank + rope]
            rotate_band(buf.transpose(0, 1), src, dst, delta, spec, band_offset=pool.kv_lora_rank)
        return
    for k_buf, v_buf in zip(pool.k_buffer, pool.v_buffer, strict=True):
        rotate_band(k_buf.transpose(0, 1), src, dst, delta, spec, band_offset=0)  # [H, rows, D]
        v_buf.index_copy_(0, dst, v_buf.index_select(0, src))


def copy_rows(pool: Any, src: torch.Tensor, dst: torch.Tensor) -> None:
    """For every layer: slots ``dst[k]`` <- slots ``src[k]``, bitwise (``dst`` disjoint)."""
    if src.numel() == 0:
        return
    buffers = list(pool.kv_buffer) if pool_kind(pool) == "mla" else [*pool.k_buffer, *pool.v_buffer]
    device = buffers[0].device
    src = src.to(device=device, dtype=torch.int64)
    dst = dst.to(device=device, dtype=torch.int64)
    for buf in buffers:
        buf.index_copy_(0, dst, buf.index_select(0, src))
