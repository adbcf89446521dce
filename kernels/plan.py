"""Validate a ``rotate_band`` call and compile it into a :class:`RotationPlan` (no mutation).

Everything a launch needs is checked here, before any byte of the buffer is written:
types, shapes, devices, index ranges, duplicate destinations, and whether a destination row
is also read by another item (then the sources are gathered first).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from leyline_agent.kernels.rope_spec import RopeSpec

KERNEL_ENV = "LEYLINE_KERNEL"
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_ABS_DELTA = 2**31 - 1


@dataclass(slots=True, frozen=True)
class RotationPlan:
    """A validated rotation: int64 index tensors on the buffer's device, length K."""

    src: torch.Tensor
    dst: torch.Tensor
    delta: torch.Tensor
    moved: torch.Tensor  # bool [K]: dst != src (copy the non-band bytes of these rows)
    any_moved: bool
    gather_first: bool  # a destination row is read by another item: read all sources first
    band_offset: int
    backend: str  # "triton" | "c" | "torch"
    max_row: int  # largest row index in src or dst (-1 when empty)
    uniform_delta: bool  # every item moves by the same delta (one directive)
    rotary_dim: int

    @property
    def num_rows(self) -> int:
        return int(self.src.numel())


def _check_buffer(buffer: object) -> torch.Tensor:
    if not isinstance(buffer, torch.Tensor):
        raise TypeError(f"buffer must be a torch.Tensor, got {type(buffer).__name__}")
    if buffer.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"buffer.dtype={buffer.dtype} is not one of {SUPPORTED_DTYPES}")
    if buffer.dim() < 2:
        raise ValueError(f"buffer must have shape (*lead, rows, width), got {tuple(buffer.shape)}")
    if buffer.device.type not in ("cpu", "cuda"):
        raise ValueError(f"buffer.device={buffer.device} is neither cpu nor cuda")
    if buffer.shape[-1] > 1 and buffer.stride(-1) != 1:
        raise ValueError(f"buffer's last dim must be contiguous (stride 1), got {buffer.stride()}")
    if torch._debug_has_internal_overlap(buffer) == 1:
        raise ValueError("buffer has internal overlap (e.g. expand()): rows would alias")
    return buffer


def _as_index(x: object, name: str, device: torch.device) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
            raise TypeError(f"{name} must be an integer tensor, got dtype {x.dtype}")
        if x.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(x.shape)}")
        if x.device != device:
            raise ValueError(f"{name}.device={x.device} differs from buffer.device={device}")
        return x.to(torch.int64)
    if isinstance(x, Sequence | range) and not isinstance(x, str | bytes):
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in x):
            raise TypeError(f"{name} must hold ints only")
        return torch.tensor(list(x), dtype=torch.int64, device=device)
    raise TypeError(
        f"{name} must be a 1-D integer tensor or a sequence of ints, got {type(x).__name__}"
    )


def _check_range(idx: torch.Tensor, name: str, rows: int) -> None:
    if idx.numel() == 0:
        return
    bad = (idx < 0) | (idx >= rows)
    if bool(bad.any()):
        k = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"{name}[{k}]={int(idx[k])} is out of range for {rows} rows (buffer.shape[-2])"
        )


def _as_delta(delta: object, k: int, device: torch.device) -> torch.Tensor:
    if isinstance(delta, bool) or not isinstance(delta, int | torch.Tensor):
        raise TypeError(f"delta must be an int or an integer tensor, got {type(delta).__name__}")
    if isinstance(delta, int):
        if abs(delta) > MAX_ABS_DELTA:
            raise ValueError(f"delta={delta} exceeds |delta| <= {MAX_ABS_DELTA}")
        return torch.full((k,), delta, dtype=torch.int64, device=device)
    if delta.dtype.is_floating_point or delta.dtype.is_complex or delta.dtype == torch.bool:
        raise TypeError(f"delta must be an integer tensor, got dtype {delta.dtype}")
    if delta.device != device:
        raise ValueError(f"delta.device={delta.device} differs from buffer.device={device}")
    if delta.dim() > 1 or (delta.dim() == 1 and delta.numel() != k):
        raise ValueError(f"delta must be a scalar or have shape ({k},), got {tuple(delta.shape)}")
    d = delta.to(torch.int64).expand(k).contiguous()
    if k and int(d.abs().max()) > MAX_ABS_DELTA:
        raise ValueError(f"delta exceeds |delta| <= {MAX_ABS_DELTA}")
    return d


def resolve_backend(device: torch.device, backend: str | None) -> str:
    """``backend`` argument, else ``$LEYLINE_KERNEL``, else triton on CUDA and the C kernel on
    CPU (which hands a plan to the torch reference where it did not build or does not take
    it: ``rotate_band_c.fits``)."""
    if backend is None:
        backend = os.environ.get(KERNEL_ENV, "").strip().lower() or "auto"
        where = f"${KERNEL_ENV}"
    else:
        where = "backend"
    if backend not in ("auto", "triton", "c", "torch"):
        raise ValueError(f"{where}={backend!r} must be 'triton', 'c', 'torch' or 'auto'")
    if backend == "auto":
        return "triton" if device.type == "cuda" else "c"
    if backend == "c" and device.type != "cpu":
        raise ValueError(f"{where}='c' runs on CPU buffers only, this one is on {device}")
    return backend


def check_plan_fits(buffer: object, plan: RotationPlan, spec: RopeSpec) -> torch.Tensor:
    """Cheap re-check (no device sync) that a plan made for one buffer fits ``buffer``."""
    buf = _check_buffer(buffer)
    if not isinstance(plan, RotationPlan):
        raise TypeError(f"plan must be a RotationPlan, got {type(plan).__name__}")
    if not isinstance(spec, RopeSpec) or spec.rotary_dim != plan.rotary_dim:
        raise ValueError("spec must be the RopeSpec the plan was made with")
    if plan.max_row >= buf.shape[-2]:
        raise ValueError(f"plan reaches row {plan.max_row} but buffer has {buf.shape[-2]} rows")
    if plan.band_offset + plan.rotary_dim > buf.shape[-1]:
        raise ValueError(f"plan's band ends at {plan.band_offset + plan.rotary_dim} > buffer width")
    if plan.src.device != buf.device:
        raise ValueError(f"plan is on {plan.src.device}, buffer on {buf.device}")
    return buf


def plan_rotation(
    buffer: object,
    src: object,
    dst: object,
    delta: object,
    spec: object,
    band_offset: object = 0,
    backend: str | None = None,
) -> RotationPlan:
    """Check every argument of ``rotate_band`` and return the plan; raises, never mutates."""
    buf = _check_buffer(buffer)
    if not isinstance(spec, RopeSpec):
        raise TypeError(f"spec must be a RopeSpec, got {type(spec).__name__}")
    if isinstance(band_offset, bool) or not isinstance(band_offset, int):
        raise TypeError(f"band_offset must be an int, got {type(band_offset).__name__}")
    rows, width = buf.shape[-2], buf.shape[-1]
    if band_offset < 0 or band_offset + spec.rotary_dim > width:
        raise ValueError(
            f"band_offset={band_offset}: band [{band_offset}, {band_offset + spec.rotary_dim}) "
            f"does not fit in buffer width {width}"
        )
    s = _as_index(src, "src", buf.device)
    d = _as_index(dst, "dst", buf.device)
    if s.numel() != d.numel():
        raise ValueError(f"src has {s.numel()} rows but dst has {d.numel()}")
    _check_range(s, "src", rows)
    _check_range(d, "dst", rows)
    # Row bitmaps instead of sort-based unique/isin: O(K + rows) on either device.
    if d.numel() and int(torch.bincount(d, minlength=rows).max()) > 1:
        raise ValueError("dst has duplicate rows: two items would write the same row")
    dl = _as_delta(delta, s.numel(), buf.device)
    chosen = resolve_backend(buf.device, backend)
    moved = s != d
    is_src = torch.zeros(rows, dtype=torch.bool, device=buf.device)
    is_src[s] = True
    is_moved_src = torch.zeros(rows, dtype=torch.bool, device=buf.device)
    is_moved_src[s[moved]] = True
    # A row written by one item and read by another: a moved item writes a source row, or an
    # in-place row is also the source of a moved item.
    gather_first = bool(is_src[d[moved]].any() | is_moved_src[d].any())
    return RotationPlan(
        src=s.contiguous(),
        dst=d.contiguous(),
        delta=dl,
        moved=moved.contiguous(),
        any_moved=bool(moved.any()),
        gather_first=gather_first,
        band_offset=band_offset,
        backend=chosen,
        max_row=int(torch.maximum(s.max(), d.max())) if s.numel() else -1,
        rotary_dim=spec.rotary_dim,
        uniform_delta=bool((dl == dl[0]).all()) if dl.numel() else True,
    )
