"""The C backend of ``rotate_band`` on CPU (``rotate_band.c``): its launcher and checks.

The reference it must equal bitwise is ``rotate_band_torch`` (``rotate_band.py``), run on
the same plan: the C loop forms the same fp32 products and sums one by one, and rounds to
bf16 the way torch does. Why: the reference gathers the rows, rotates them through a
handful of full-size temporaries and scatters them back, several passes over the tail a
splice moves; the kernel reads each source row once and writes each destination once
(docs/measurements.md, ``bench_splice``: the tail move).

Takes fp32 and bf16 buffers on CPU whose plan needs no gathering first (no item reads a
row another writes: ``RotationPlan.gather_first``); ``fits`` says so, and ``rotate_band``
sends every other plan to the reference. Compiled on first use (``cbuild.py``).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from leyline_agent.kernels import cbuild
from leyline_agent.kernels.launches import LAUNCHES
from leyline_agent.kernels.plan import RotationPlan
from leyline_agent.kernels.rope_spec import RopeSpec, rotation_cos_sin

__all__ = ["available", "build_error", "fits", "rotate_band_c"]

_SOURCE = Path(__file__).with_name("rotate_band.c")
_DTYPES = (torch.float32, torch.bfloat16)
PARALLEL_MIN = 1 << 18  # elements of rows touched from which threads share the items


def fits(buffer: torch.Tensor, plan: RotationPlan) -> bool:
    """Whether the kernel takes this (checked) plan: built, CPU, fp32 or bf16, no gather."""
    return (
        buffer.device.type == "cpu"
        and buffer.dtype in _DTYPES
        and not plan.gather_first
        and available()
    )


def rotate_band_c(buffer: torch.Tensor, plan: RotationPlan, spec: RopeSpec) -> None:
    """Run ``plan`` (from ``plan_rotation``, checked against ``buffer``) with the C kernel.
    MUTATES ``buffer``; ValueError (before any write) for a plan it does not take."""
    if not fits(buffer, plan):
        raise ValueError(
            "rotate_band_c: plan or buffer the kernel does not take "
            f"(device {buffer.device}, dtype {buffer.dtype}, gather_first {plan.gather_first}; "
            f"built: {build_error() or 'yes'})"
        )
    lib = _LIB.get()
    assert lib is not None
    LAUNCHES.c += 1
    delta = plan.delta[:1] if plan.uniform_delta else plan.delta
    cos, sin = (t.contiguous() for t in rotation_cos_sin(delta, spec))
    lead = _lead_offsets(buffer)
    moved = plan.moved.to(torch.uint8).contiguous()
    ptr = ctypes.c_void_p
    rc = lib.ll_rotate(
        buffer.data_ptr(), int(buffer.dtype == torch.bfloat16), lead.numel(),
        ptr(lead.data_ptr()), plan.num_rows, ptr(plan.src.data_ptr()),
        ptr(plan.dst.data_ptr()), ptr(moved.data_ptr()), buffer.stride(-2), buffer.shape[-1],
        plan.band_offset, spec.rotary_dim // 2, int(spec.layout == "interleaved"),
        ptr(cos.data_ptr()), ptr(sin.data_ptr()), 0 if plan.uniform_delta else cos.stride(0),
        torch.get_num_threads(), PARALLEL_MIN,
    )  # fmt: skip
    assert rc == 0


def _lead_offsets(buffer: torch.Tensor) -> torch.Tensor:
    """Element offsets of every lead index of ``(*lead, rows, width)`` (row 0 of each)."""
    off = torch.zeros((), dtype=torch.long)
    for size, stride in zip(buffer.shape[:-2], buffer.stride()[:-2], strict=True):
        off = off[..., None] + torch.arange(size, dtype=torch.long) * stride
    return off.reshape(-1).contiguous()


def available() -> bool:
    """Whether the C kernel is built and loaded on this machine."""
    return _LIB.get() is not None


def build_error() -> str | None:
    """Why the kernel is not available (None if it is)."""
    return _LIB.error


def _declare(lib: ctypes.CDLL) -> None:
    i, i64, p = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
    lib.ll_rotate.argtypes = [
        i64, i, i64, p,  # buffer ptr, bf16, leads, lead offsets
        i64, p, p, p,  # items, src, dst, moved
        i64, i64, i64, i64, i,  # row stride, width, band offset, half, interleaved
        p, p, i64,  # cos, sin, their row stride (0: one row)
        i, i64,  # nthreads, parallel_min
    ]  # fmt: skip
    lib.ll_rotate.restype = i


_LIB = cbuild.Library(_SOURCE, _declare)
