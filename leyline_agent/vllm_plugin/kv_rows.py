"""Rows of vLLM 0.32's CPU KV cache: read them, write them, learn the layout from the op.

One attention layer's cache is ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``
(``CPUAttentionBackendImpl.forward``), viewed by the backend as ``[num_blocks, kv_heads,
2 * block_size, head_size]`` and split in two: keys, then values. Inside each (block,
head) chunk the backend's write op (``cpu_attn_reshape_and_cache``, per ISA) decides where
the element ``(token t, dim d)`` goes: on the fp32 "vec" path the keys are stored
transposed (``d * B + t``) and the values row-major (``t * D + d``). There is no read op.

So the layout is not assumed: :func:`probe_layout` writes known rows with the backend's own
op into a scratch cache of the same shape class and finds where they landed. Writes go
through that op (:func:`write_rows`); reads (:func:`read_rows`) use the probed layout. A
layout the probe cannot explain is refused (``UnsupportedLayoutError``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from leyline_agent.errors import RuntimeUnavailableError

__all__ = ["Layout", "UnsupportedLayoutError", "probe_layout", "read_rows", "write_rows"]


class UnsupportedLayoutError(RuntimeUnavailableError):
    """The KV cache's layout is not one the plugin can read back."""


@dataclass(slots=True, frozen=True)
class Layout:
    isa: str
    keys_transposed: bool  # key (t, d) at d * B + t inside its (block, head) chunk


def _split(kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    nb, h, b, _ = kv.shape
    return kv.view(nb, h, 2 * b, -1).chunk(2, dim=2)  # as the backend does


def write_rows(
    kv: torch.Tensor, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, isa: str
) -> None:
    """Write ``keys``/``values`` ``[N, kv_heads, head_size]`` at ``slots`` (the backend's op)."""
    from vllm import _custom_ops as ops

    key_cache, value_cache = _split(kv)
    ops.cpu_attn_reshape_and_cache(
        keys.contiguous(), values.contiguous(), key_cache, value_cache, slots, isa
    )


def read_rows(
    kv: torch.Tensor, slots: torch.Tensor, layout: Layout
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values ``[N, kv_heads, head_size]`` at ``slots`` (copies)."""
    nb, h, b, two_d = kv.shape
    d = two_d // 2
    flat = kv.view(nb, h, 2 * b * d)
    blk = (slots // b)[:, None, None]
    off = (slots % b)[:, None, None]
    heads = torch.arange(h)[None, :, None]
    dims = torch.arange(d)[None, None, :]
    kpos = dims * b + off if layout.keys_transposed else off * d + dims
    keys = flat[blk, heads, kpos]
    values = flat[blk, heads, b * d + off * d + dims]
    return keys, values


def probe_layout(kv: torch.Tensor, isa: str) -> Layout:
    """Find the layout of ``kv``'s shape class by writing known rows with the backend's op
    into a two-block scratch cache (``kv`` itself is not touched)."""
    _, h, b, two_d = kv.shape
    scratch = torch.zeros((2, h, b, two_d), dtype=kv.dtype)
    gen = torch.Generator().manual_seed(0)
    n = b
    keys = torch.randn((n, h, two_d // 2), generator=gen).to(kv.dtype)
    values = torch.randn((n, h, two_d // 2), generator=gen).to(kv.dtype)
    slots = torch.arange(b, 2 * b, dtype=torch.int64).roll(3)  # block 1, shuffled offsets
    write_rows(scratch, slots, keys, values, isa)
    for transposed in (True, False):
        layout = Layout(isa=isa, keys_transposed=transposed)
        k, v = read_rows(scratch, slots, layout)
        if torch.equal(k, keys) and torch.equal(v, values):
            return layout
    raise UnsupportedLayoutError(
        f"kv_cache_layout: the CPU backend's '{isa}' path ({kv.dtype}) stores rows in a layout "
        "the Leyline plugin cannot read back"
    )
