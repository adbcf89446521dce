"""RoPE from scratch in float64: the independent yardstick the kernel tests measure against.

It shares nothing with ``rotate_band``: it takes the frequencies, magnitude and pair layout
as plain arguments (tests read them from the model's own rotary module) and applies the
absolute rotation ``scaling · R(position · inv_freq)`` to an un-rotated key.
"""

from __future__ import annotations

import torch


def rope_float64(
    key: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    layout: str,
    band_offset: int = 0,
    scaling: float = 1.0,
) -> torch.Tensor:
    """Post-RoPE keys of ``key`` (``[width]``) at ``positions`` (``[N]``): ``[N, width]`` fp64.

    The band ``[band_offset, band_offset + 2 * len(inv_freq))`` is rotated (pairs per
    ``layout``) and multiplied by ``scaling``; the other columns are copied.
    """
    k = key.to(torch.float64)
    f = inv_freq.to(torch.float64)
    half = f.numel()
    band = k[band_offset : band_offset + 2 * half]
    if layout == "interleaved":
        a, b = band[0::2], band[1::2]
    elif layout == "half":
        a, b = band[:half], band[half:]
    else:
        raise ValueError(f"layout={layout!r}")
    angle = positions.to(torch.float64)[:, None] * f[None, :]
    cos, sin = angle.cos() * scaling, angle.sin() * scaling
    new_a, new_b = a * cos - b * sin, b * cos + a * sin
    if layout == "interleaved":
        new_band = torch.stack((new_a, new_b), dim=-1).flatten(-2)
    else:
        new_band = torch.cat((new_a, new_b), dim=-1)
    out = k.expand(positions.numel(), -1).clone()
    out[:, band_offset : band_offset + 2 * half] = new_band
    return out
