"""δ-rotation of cached RoPE keys: the public ``rotate_band`` and its torch reference.

Shapes: ``buffer`` is ``(*lead, rows, width)`` (lead = batch / heads; any strides, last dim
contiguous); ``src``, ``dst``: ``[K]`` row indices; ``delta``: int or ``[K]`` ints; the
rotary band is ``[band_offset, band_offset + spec.rotary_dim)`` of the last dim.

For every lead index and every k::

    buffer[..., dst[k], band] = R(delta[k] * inv_freq) . buffer[..., src[k], band]

computed in fp32 (angles reduced in fp64, see below) and stored in ``buffer.dtype``. When
``dst[k] != src[k]`` the rest of the row is copied bitwise (copy-on-write of whole rows);
when equal the rotation is in place and the non-band bytes are not written. All sources are
read before any destination is written (overlapping src/dst sets are safe).

Backends: the Triton kernel (``rotate_band_triton.py``; on CPU tensors it runs under the
Triton interpreter), a C kernel for CPU buffers (``rotate_band_c.py``: fp32 and bf16, plans
that need no gathering first; the rest go to the reference) and the torch reference below.
Default: Triton for CUDA buffers, C for CPU buffers where it built, else torch;
``$LEYLINE_KERNEL=triton|c|torch`` or the ``backend=`` argument overrides.

Precision: ``delta * inv_freq`` is formed in fp64, where it is exact for |delta| < 2**29
(inv_freq has 24 significant bits), and reduced modulo 2π before the fp32 cos/sin. In plain
fp32 the product alone may be off by half an fp32 spacing: up to 6e-5 rad at |delta * f| ~
1024 (the whole 5e-5 error budget) and 4e-3 rad at 1e5, growing linearly with |delta|
(``test_large_delta_keeps_fp64_angle_accuracy`` fails with an fp32 angle). fp64 costs a few
flops per (row, pair) in a memory-bound kernel.
"""

from __future__ import annotations

import torch

from leyline_agent.kernels.launches import LAUNCHES
from leyline_agent.kernels.plan import RotationPlan, check_plan_fits, plan_rotation
from leyline_agent.kernels.rope_spec import RopeSpec, rotation_cos_sin


def rotate_band(
    buffer: torch.Tensor,
    src: torch.Tensor | list[int],
    dst: torch.Tensor | list[int],
    delta: int | torch.Tensor,
    spec: RopeSpec,
    band_offset: int = 0,
    *,
    backend: str | None = None,
) -> None:
    """Rotate the RoPE band of rows ``src`` by ``delta`` positions into rows ``dst``.

    MUTATES ``buffer`` (writes go to its underlying storage, also through views) and returns
    None. Every argument is validated before anything is written: on ``TypeError`` /
    ``ValueError`` the buffer is bitwise unchanged. ``backend``: ``"triton"``, ``"torch"`` or
    None (``$LEYLINE_KERNEL``, else by device).
    """
    plan = plan_rotation(buffer, src, dst, delta, spec, band_offset, backend)
    _run(buffer, plan, spec)


def apply_plan(buffer: torch.Tensor, plan: RotationPlan, spec: RopeSpec) -> None:
    """Run a plan from ``plan_rotation`` on ``buffer`` (e.g. the same splice on every layer).

    Index validation (which syncs with the device) is paid once in ``plan_rotation``; here only
    cheap checks of ``buffer`` against the plan run. MUTATES ``buffer``.
    """
    check_plan_fits(buffer, plan, spec)
    _run(buffer, plan, spec)


def _run(buffer: torch.Tensor, plan: RotationPlan, spec: RopeSpec) -> None:
    if plan.num_rows == 0:
        return
    if plan.backend == "triton":
        from leyline_agent.kernels.rotate_band_triton import rotate_band_triton

        rotate_band_triton(buffer, plan, spec)
        return
    if plan.backend == "c":
        from leyline_agent.kernels import rotate_band_c

        if rotate_band_c.fits(buffer, plan):
            rotate_band_c.rotate_band_c(buffer, plan, spec)
            return
    rotate_band_torch(buffer, plan, spec)


def pair_views(band: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The two members ``(a, b)`` of every rotary pair of ``band`` (``[..., rotary_dim]``)."""
    if layout == "interleaved":
        return band[..., 0::2], band[..., 1::2]
    half = band.shape[-1] // 2
    return band[..., :half], band[..., half:]


def rotate_band_torch(buffer: torch.Tensor, plan: RotationPlan, spec: RopeSpec) -> None:
    """Torch reference (and CPU path): gather, rotate the band in fp32, scatter.

    All reads (full source rows of moved items, source bands of in-place items) happen before
    the first write, so overlapping src/dst sets are safe.
    """
    LAUNCHES.torch += 1
    lo, hi = plan.band_offset, plan.band_offset + spec.rotary_dim
    band = buffer[..., lo:hi]
    moved = plan.moved.nonzero().squeeze(1)
    still = (~plan.moved).nonzero().squeeze(1)
    rows = buffer.index_select(-2, plan.src[moved]) if moved.numel() else None
    kept = band.index_select(-2, plan.src[still]) if still.numel() else None
    if rows is not None:
        _rotate_gathered(rows[..., lo:hi], plan.delta[moved], spec, plan.uniform_delta)
        buffer.index_copy_(-2, plan.dst[moved], rows)
    if kept is not None:
        _rotate_gathered(kept, plan.delta[still], spec, plan.uniform_delta)
        band.index_copy_(-2, plan.dst[still], kept)


def _rotate_gathered(x: torch.Tensor, delta: torch.Tensor, spec: RopeSpec, uniform: bool) -> None:
    """Rotate the gathered bands ``x`` (``[..., K, rotary_dim]``, a private copy) in place."""
    a, b = pair_views(x, spec.layout)
    fa, fb = a.to(torch.float32), b.to(torch.float32)
    cos, sin = rotation_cos_sin(delta[:1] if uniform else delta, spec)  # [K or 1, half]
    new_a, new_b = fa * cos - fb * sin, fb * cos + fa * sin  # both before any write
    a.copy_(new_a)  # rounds to the buffer dtype (nearest even)
    b.copy_(new_b)
