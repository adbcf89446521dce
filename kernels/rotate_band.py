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
Triton interpreter) and the torch reference below. Default: Triton for CUDA buffers, torch
for CPU buffers; ``$LEYLINE_KERNEL=triton|torch`` or the ``backend=`` argument overrides.

Precision: ``delta * inv_freq`` is formed in fp64, where it is exact for |delta| < 2**29
(inv_freq has 24 significant bits), and reduced modulo 2π before the fp32 cos/sin. In plain
fp32 the angle alone would carry up to ~6e-5 rad of rounding error at |delta| = 1024 and
inv_freq ~ 1 (fp32 spacing at 1024 is 1.2e-4), as large as the 5e-5 error budget.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from leyline_agent.kernels.plan import RotationPlan, plan_rotation
from leyline_agent.kernels.rope_spec import RopeSpec


@dataclass(slots=True)
class LaunchCounter:
    """How many times each backend actually ran (read by tests and benchmarks)."""

    triton: int = 0
    torch: int = 0


LAUNCHES = LaunchCounter()


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
    if plan.num_rows == 0:
        return
    if plan.backend == "triton":
        from leyline_agent.kernels.rotate_band_triton import rotate_band_triton

        rotate_band_triton(buffer, plan, spec)
    else:
        rotate_band_torch(buffer, plan, spec)


def rotation_cos_sin(delta: torch.Tensor, spec: RopeSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``cos, sin`` of ``delta[k] * inv_freq[j]``, shape ``[K, rotary_dim // 2]``.

    The angle is formed and its cos/sin taken in fp64 (exact product, accurate reduction).
    """
    inv_freq = spec.inv_freq_tensor(delta.device).to(torch.float64)
    angle = delta.to(torch.float64)[:, None] * inv_freq[None, :]
    return angle.cos().to(torch.float32), angle.sin().to(torch.float32)


def pair_views(band: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The two members ``(a, b)`` of every rotary pair of ``band`` (``[..., rotary_dim]``)."""
    if layout == "interleaved":
        return band[..., 0::2], band[..., 1::2]
    half = band.shape[-1] // 2
    return band[..., :half], band[..., half:]


def rotate_band_torch(buffer: torch.Tensor, plan: RotationPlan, spec: RopeSpec) -> None:
    """Torch reference (and CPU path): gather rows, rotate the band in fp32, scatter rows."""
    LAUNCHES.torch += 1
    lo, hi = plan.band_offset, plan.band_offset + spec.rotary_dim
    rows = buffer.index_select(-2, plan.src)  # [*lead, K, width], a copy: all reads first
    a, b = pair_views(rows[..., lo:hi].to(torch.float32), spec.layout)
    cos, sin = rotation_cos_sin(plan.delta, spec)  # [K, half], broadcast over lead dims
    new_a, new_b = a * cos - b * sin, b * cos + a * sin
    out_a, out_b = pair_views(rows[..., lo:hi], spec.layout)
    out_a.copy_(new_a)
    out_b.copy_(new_b)
    if plan.any_moved:
        moved = plan.moved.nonzero().squeeze(1)
        buffer.index_copy_(-2, plan.dst[moved], rows.index_select(-2, moved))
    still = (~plan.moved).nonzero().squeeze(1)
    if still.numel():
        band = buffer[..., lo:hi]
        band.index_copy_(-2, plan.dst[still], rows[..., lo:hi].index_select(-2, still))
