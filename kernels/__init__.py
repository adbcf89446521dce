"""δ-rotation kernels: move cached post-RoPE keys to new positions without a forward pass.

Public API::

    from leyline_agent.kernels import RopeSpec, rotate_band, band_offset_for

    spec = RopeSpec.from_hf_config(config, cache_owner="transformers")  # or "sglang"
    rotate_band(buffer, src, dst, delta, spec, band_offset=band_offset_for(config, owner))

To run one splice on many layers, validate once and reuse the plan::

    plan = plan_rotation(layer0, src, dst, delta, spec, band_offset)
    for buf in layers:
        apply_plan(buf, plan, spec)

``rotate_band`` / ``apply_plan`` mutate ``buffer`` in place (returns None). See ``rope_spec.py`` for which
engine caches which pair layout and where the band sits in a cache row, and
``rotate_band.py`` for the exact semantics, backends and precision.
"""

from leyline_agent.kernels.launches import LAUNCHES
from leyline_agent.kernels.plan import KERNEL_ENV, RotationPlan, plan_rotation
from leyline_agent.kernels.rope_spec import RopeSpec, band_offset_for
from leyline_agent.kernels.rotate_band import apply_plan, rotate_band, rotate_band_torch

__all__ = [
    "KERNEL_ENV",
    "LAUNCHES",
    "RopeSpec",
    "RotationPlan",
    "apply_plan",
    "band_offset_for",
    "plan_rotation",
    "rotate_band",
    "rotate_band_torch",
]
