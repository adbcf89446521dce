"""Rows of one paged attention cache: read them, write them, move them with their keys
turned, and learn the layout from the engine's own write op (engine-neutral: torch only).

A paged cache is read here as the logical ``[B, H, N, C]`` (blocks, head slots, rows per
block, content). Which elements make up the row of slot ``s`` is the layout's business
(``RowLayout``), and that is the engine's write op's business, so it is not assumed:
:func:`probe_layout` keeps the candidate under which the rows the backend's own op wrote
into a scratch cache read back, and this module's writes leave the very same bytes (vLLM's
candidates: ``vllm_plugin.cache_layout``). Keys are the first ``key_width`` elements of a
row (the latent ``[kv_lora_rank | rope]`` for MLA, whose ``value_width`` is 0), values the
next ``value_width``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from leyline_agent.errors import RuntimeUnavailableError
from leyline_agent.kernels.plan import RotationPlan, plan_rotation
from leyline_agent.kernels.rope_spec import RopeSpec
from leyline_agent.kernels.rotate_band import apply_plan

__all__ = [
    "BackendWrite",
    "RowLayout",
    "UnsupportedLayoutError",
    "move_rows",
    "probe_layout",
    "read_rows",
    "read_sequence",
    "scratch_like",
    "write_rows",
]


class UnsupportedLayoutError(RuntimeUnavailableError):
    """The KV cache's layout is not one this module can read back."""


@dataclass(slots=True, frozen=True)
class RowLayout:
    """Where the row of slot ``s`` lives in one layer's logical ``[B, H, N, C]`` cache.

    ``paged``: at ``kv[s // N, :, s % N, :]``, key ``[:key_width]`` then value. ``chunk``:
    each (block, head) chunk read as ``N * C`` elements, keys first (at ``d * N + t`` when
    ``keys_transposed``, else ``t * D + d``), values after them row-major (the CPU op).
    """

    kind: Literal["paged", "chunk"]
    key_width: int
    value_width: int
    keys_transposed: bool = False


# (cache, slots [N], keys [N, H, key_width], values [N, H, value_width]) -> None
BackendWrite = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


def _views(kv: torch.Tensor, layout: RowLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values of every row as ``[B, H, N, width]`` views of the cache: a slot's
    row is then one index pair ``(slot // N, slot % N)``, the same for every layer and head.
    A chunk-layout cache's (block, head) chunk is read as ``N * C`` elements: keys first
    (``[D, N]`` when ``keys_transposed``, else ``[N, D]``), then the values ``[N, D]``."""
    k = layout.key_width
    if layout.kind == "paged":
        return kv[..., :k], kv[..., k : k + layout.value_width]
    _, h, b, c = kv.shape
    flat = kv.view(kv.shape[0], h, b * c)
    keys = flat[:, :, : b * k].unflatten(2, (k, b) if layout.keys_transposed else (b, k))
    keys = keys.transpose(2, 3) if layout.keys_transposed else keys
    return keys, flat[:, :, b * k : 2 * b * k].unflatten(2, (b, k))


def _run(slots: torch.Tensor, b: int) -> tuple[torch.Tensor, int] | None:
    """``(blocks, offset)`` when ``slots`` are consecutive rows of a sequence laid block after
    block (row ``i`` at ``blocks[(offset + i) // b] * b + (offset + i) % b``), else None."""
    n = slots.numel()
    if n < 2 * b:  # not worth a check
        return None
    offset = int(slots[0]) % b
    pos = torch.arange(offset, offset + n, device=slots.device)
    firsts = (torch.arange(0, (offset + n - 1) // b + 1, device=slots.device) * b - offset).clamp_(
        0
    )
    blocks = slots[firsts] // b
    if not torch.equal(blocks[pos // b] * b + pos % b, slots):
        return None
    return blocks, offset


def read_rows(
    kv: torch.Tensor, slots: torch.Tensor, layout: RowLayout
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys ``[N, H, key_width]`` and values ``[N, H, value_width]`` at ``slots`` (copies;
    a run of consecutive rows of a sequence, ``_run``, is read as its whole blocks)."""
    run = _run(slots, kv.shape[2])
    if run is not None:
        blocks, offset = run
        n = slots.numel()
        keys, values = read_sequence(kv, blocks, offset + n, layout)
        return keys[:, offset:].transpose(0, 1), values[:, offset:].transpose(0, 1)
    keys, values = _views(kv, layout)
    blk, off = slots // kv.shape[2], slots % kv.shape[2]
    return keys[blk, :, off], values[blk, :, off]


def read_sequence(
    kv: torch.Tensor, blocks: torch.Tensor, n: int, layout: RowLayout
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys ``[H, n, key_width]`` and values ``[H, n, value_width]`` of the first ``n`` rows
    of the sequence whose blocks are ``blocks`` in order (row ``p`` at slot
    ``blocks[p // N] * N + p % N``): whole blocks copied out, not row by row (copies)."""
    keys, values = _views(kv.index_select(0, blocks), layout)  # [nb, H, N, width]
    h = kv.shape[1]
    return (
        keys.transpose(0, 1).reshape(h, -1, layout.key_width)[:, :n],
        values.transpose(0, 1).reshape(h, -1, layout.value_width)[:, :n],
    )


def write_rows(
    kv: torch.Tensor, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
    layout: RowLayout,
) -> None:  # fmt: skip
    """Write ``keys``/``values`` (as :func:`read_rows` returns them) at ``slots``."""
    key_view, value_view = _views(kv, layout)
    blk, off = slots // kv.shape[2], slots % kv.shape[2]
    key_view[blk, :, off] = keys.to(kv.dtype)
    if layout.value_width:
        value_view[blk, :, off] = values.to(kv.dtype)


def move_rows(
    kv: torch.Tensor, layout: RowLayout, src: torch.Tensor, dst: torch.Tensor,
    delta: torch.Tensor, spec: RopeSpec | None, band_offset: int,
    plan: RotationPlan | None = None,
) -> RotationPlan | None:  # fmt: skip
    """Copy the rows at ``src`` to ``dst`` (fresh slots), the keys of rows with a nonzero
    ``delta`` turned by it (their band at ``band_offset``; ``kernels.apply_plan``: the torch
    path on CPU, the project's kernel on CUDA). Every row is read before any is written.
    Returns the rotation plan, to be passed back for the next layer of the same move."""
    keys, values = read_rows(kv, src, layout)
    moved = (delta != 0).nonzero().squeeze(1)
    every = moved.numel() == delta.numel()  # a splice's tail: every row turns
    if moved.numel():
        assert spec is not None
        band = (keys if every else keys.index_select(0, moved)).transpose(0, 1).contiguous()
        if plan is None:  # [H, K, W] rotated in place: the C kernel on CPU, Triton on CUDA
            idx = torch.arange(moved.numel(), device=kv.device)
            plan = plan_rotation(band, idx, idx, delta[moved], spec, band_offset)
        apply_plan(band, plan, spec)
        if every:
            keys = band.transpose(0, 1)
        else:
            keys.index_copy_(0, moved, band.transpose(0, 1))
    write_rows(kv, dst, keys, values, layout)
    return plan


def scratch_like(kv: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """A zeroed ``[num_blocks, H, N, C]`` cache whose axes lie in memory in ``kv``'s order."""
    order = sorted(range(4), key=lambda i: (-kv.stride(i), i))
    shape = [num_blocks if i == 0 else kv.shape[i] for i in order]
    flat = torch.zeros(shape, dtype=kv.dtype, device=kv.device)
    return flat.permute([order.index(i) for i in range(4)])


def probe_layout(
    kv: torch.Tensor, candidates: Sequence[RowLayout], write: BackendWrite, backend: str
) -> RowLayout:
    """The candidate that explains where ``write`` (the backend's op) stores known rows;
    ``kv`` itself is not touched."""
    _, h, b, _ = kv.shape
    first = candidates[0]
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn((b, h, first.key_width), generator=gen).to(kv.dtype).to(kv.device)
    values = torch.randn((b, h, first.value_width), generator=gen).to(kv.dtype).to(kv.device)
    slots = torch.arange(b, 2 * b, dtype=torch.int64, device=kv.device).roll(3)  # block 1
    by_op = scratch_like(kv, 2)
    write(by_op, slots, keys, values)
    for layout in candidates:
        try:
            k, v = read_rows(by_op, slots, layout)
            ours = scratch_like(kv, 2)
            write_rows(ours, slots, keys, values, layout)
        except RuntimeError:  # this candidate cannot even view the cache
            continue
        if torch.equal(k, keys) and torch.equal(v, values) and torch.equal(ours, by_op):
            return layout
    raise UnsupportedLayoutError(
        f"kv_cache_layout: backend {backend}: its write op stores rows ({kv.dtype}, "
        f"cache shape {list(kv.shape)}, strides {list(kv.stride())}) where the plugin "
        "cannot read them back"
    )
