"""Triton kernel for ``rotate_band`` and its launcher.

Shapes (per launch): ``src``/``dst`` views ``[L, rows, width]`` (any lead/row strides, last
dim contiguous); ``src_rows``, ``dst_rows``, ``delta``: int64 ``[K]``; ``moved``: int8 ``[K]``;
``inv_freq``: fp32 ``[HALF]``. One program handles ``BLOCK_R`` items, an item being one
(lead index, k) pair: it rotates the band (cos/sin from ``delta`` and ``inv_freq`` in-kernel:
the angle is formed and reduced mod 2π in fp64, cos/sin in fp32) and, for moved rows, copies
the non-band columns bitwise in ``BLOCK_W``-wide chunks.

On CUDA tensors the kernel is compiled by ``triton.jit``; on CPU tensors it runs under the
Triton interpreter (the same kernel body, built as an interpreted function here, so
``TRITON_INTERPRET`` does not have to be set before triton is imported).
"""

from __future__ import annotations

import functools
import itertools
import math
import struct

import torch
import triton
import triton.language as tl

from leyline_agent.kernels.launches import LAUNCHES
from leyline_agent.kernels.plan import RotationPlan
from leyline_agent.kernels.rope_spec import RopeSpec


def _fp32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


# 2π = TWO_PI_HI + TWO_PI_LO to ~2**-48 relative; both are exact fp32 values, so however a
# literal is materialised (fp32 or fp64) its value is the same.
# (Globals read inside a @triton.jit body must be constexpr.)
TWO_PI_HI = tl.constexpr(_fp32(2 * math.pi))
TWO_PI_LO = tl.constexpr(_fp32(2 * math.pi - _fp32(2 * math.pi)))
INV_TWO_PI = tl.constexpr(_fp32(1 / (2 * math.pi)))
BLOCK_R = 16
BLOCK_W = 128


def _rotate_band_kernel(
    src_ptr,
    dst_ptr,
    src_rows_ptr,
    dst_rows_ptr,
    delta_ptr,
    moved_ptr,
    inv_freq_ptr,
    n_items,
    n_k,
    src_stride_l,
    src_stride_r,
    dst_stride_l,
    dst_stride_r,
    width,
    band_offset,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    COPY_ROWS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_W: tl.constexpr,
    OUT_BF16: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    items = pid * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)  # [R]
    live = items < n_items
    lead = items // n_k
    k = items % n_k
    src_row = tl.load(src_rows_ptr + k, mask=live, other=0)
    dst_row = tl.load(dst_rows_ptr + k, mask=live, other=0)
    src_base = src_ptr + lead * src_stride_l + src_row * src_stride_r  # [R] pointers
    dst_base = dst_ptr + lead * dst_stride_l + dst_row * dst_stride_r

    # Angles [R, H]: exact product in fp64, reduced to [-π, π], then fp32 cos/sin.
    j = tl.arange(0, BLOCK_H)
    jm = j < HALF
    freq = tl.load(inv_freq_ptr + j, mask=jm, other=0.0).to(tl.float64)
    d = tl.load(delta_ptr + k, mask=live, other=0).to(tl.float64)
    angle = d[:, None] * freq[None, :]
    turns = tl.floor(angle * INV_TWO_PI + 0.5)
    reduced = ((angle - turns * TWO_PI_HI) - turns * TWO_PI_LO).to(tl.float32)
    cos = tl.cos(reduced)
    sin = tl.sin(reduced)

    if INTERLEAVED:
        col_a = band_offset + 2 * j
        col_b = col_a + 1
    else:
        col_a = band_offset + j
        col_b = col_a + HALF
    m2 = live[:, None] & jm[None, :]
    xa = tl.load(src_base[:, None] + col_a[None, :], mask=m2, other=0.0).to(tl.float32)
    xb = tl.load(src_base[:, None] + col_b[None, :], mask=m2, other=0.0).to(tl.float32)
    ya = xa * cos - xb * sin
    yb = xb * cos + xa * sin
    if OUT_BF16:
        # Round to nearest even by hand: the Triton interpreter's fp32 -> bf16 cast truncates,
        # and the same bits on GPU (cvt.rn) and CPU keep the two paths comparable.
        # (Inlined: a @triton.jit helper cannot be called from the interpreted kernel.)
        # NaN -> canonical quiet NaN, as torch does.
        a_bits = ya.to(tl.uint32, bitcast=True)
        b_bits = yb.to(tl.uint32, bitcast=True)
        a_bits = tl.where(ya != ya, 0x7FC00000, a_bits + 0x7FFF + ((a_bits >> 16) & 1))
        b_bits = tl.where(yb != yb, 0x7FC00000, b_bits + 0x7FFF + ((b_bits >> 16) & 1))
        ya = (a_bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        yb = (b_bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    out_ty = dst_ptr.dtype.element_ty
    tl.store(dst_base[:, None] + col_a[None, :], ya.to(out_ty), mask=m2)
    tl.store(dst_base[:, None] + col_b[None, :], yb.to(out_ty), mask=m2)

    if COPY_ROWS:
        moved = tl.load(moved_ptr + k, mask=live, other=0) != 0
        band_end = band_offset + 2 * HALF
        for w0 in range(0, width, BLOCK_W):
            cols = w0 + tl.arange(0, BLOCK_W)
            keep = (cols < width) & ((cols < band_offset) | (cols >= band_end))
            mc = (live & moved)[:, None] & keep[None, :]
            v = tl.load(src_base[:, None] + cols[None, :], mask=mc)
            tl.store(dst_base[:, None] + cols[None, :], v, mask=mc)


_compiled = triton.jit(_rotate_band_kernel)


@functools.cache
def _interpreted():
    from triton.runtime.interpreter import InterpretedFunction

    return InterpretedFunction(_rotate_band_kernel)


def _kernel_for(device: torch.device):
    return _compiled if device.type == "cuda" else _interpreted()


def _as_3d(t: torch.Tensor) -> list[torch.Tensor] | None:
    """``t`` as one ``[L, rows, width]`` view, or None when its lead dims don't collapse."""
    if t.dim() == 2:
        return [t.unsqueeze(0)]
    try:
        return [t.view(-1, t.shape[-2], t.shape[-1])]
    except RuntimeError:
        return None


def _launch(src: torch.Tensor, dst: torch.Tensor, src_rows, plan: RotationPlan, spec: RopeSpec):
    # Internal invariants (the plan validated the user's input).
    assert src.stride(-1) == 1 and dst.stride(-1) == 1 and src.shape[0] == dst.shape[0]
    n_k = plan.num_rows
    n_items = src.shape[0] * n_k
    if n_items == 0:
        return
    grid = (triton.cdiv(n_items, BLOCK_R),)
    _kernel_for(dst.device)[grid](
        src,
        dst,
        src_rows,
        plan.dst,
        plan.delta,
        plan.moved.to(torch.int8),
        spec.inv_freq_tensor(dst.device),
        n_items,
        n_k,
        src.stride(0),
        src.stride(1),
        dst.stride(0),
        dst.stride(1),
        dst.shape[-1],
        plan.band_offset,
        HALF=spec.half,
        BLOCK_H=triton.next_power_of_2(spec.half),
        INTERLEAVED=spec.layout == "interleaved",
        COPY_ROWS=plan.any_moved,
        BLOCK_R=BLOCK_R,
        BLOCK_W=BLOCK_W,
        OUT_BF16=dst.dtype == torch.bfloat16,
    )
    LAUNCHES.triton += 1


def rotate_band_triton(buffer: torch.Tensor, plan: RotationPlan, spec: RopeSpec) -> None:
    """Launch the kernel for a validated ``plan`` (see ``rotate_band`` for the contract)."""
    if plan.gather_first:
        # A destination row is read by another item: programs run in any order, so read every
        # source row into a contiguous copy first and rotate from there.
        source = buffer.index_select(-2, plan.src)
        src_rows = torch.arange(plan.num_rows, dtype=torch.int64, device=buffer.device)
    else:
        source, src_rows = buffer, plan.src
    dst3, src3 = _as_3d(buffer), _as_3d(source)
    if dst3 is not None and src3 is not None:
        _launch(src3[0], dst3[0], src_rows, plan, spec)
        return
    # Lead dims that don't collapse into one: one launch per index of all but the last.
    for idx in itertools.product(*(range(n) for n in buffer.shape[:-3])):
        _launch(source[idx], buffer[idx], src_rows, plan, spec)
