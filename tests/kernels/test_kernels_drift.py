"""bf16 storage: drift of repeatedly δ-rotated keys, fp32 compute (ours) vs bf16 compute (naive).

The exact result is the float64 rotation, by the cumulative Δ, of the keys as first stored in
bf16, so only what the rotations add is measured. Drift = ||band - exact|| / ||exact|| (L2
over all rows).
"""

from __future__ import annotations

import pytest
import torch

from leyline_agent.kernels import RopeSpec, rotate_band
from leyline_agent.kernels.reference import rope_float64
from leyline_agent.kernels.rotate_band import pair_views
from leyline_agent.reference.rope_configs import deepseek_v2_yarn

# Bound for n rotations. bf16 keeps 8 significant bits: one round-to-nearest has relative
# error <= u = 2**-8, so each rotation (one rounding per element at the end, the fp32 math
# adds ~1e-7) adds an error of rel-L2 <= u, and the orthogonal rotations that follow neither
# grow nor shrink earlier errors. Round-to-nearest-even errors are unbiased and uncorrelated
# from step to step, so they add like a random walk: <= u * sqrt(n). (Expected value ~0.42 u
# sqrt(n): uniform rounding error over a log-uniform mantissa; the worst case n * u needs
# biased rounding, which is what a truncating cast would give.)
BF16_U = 2.0**-8
STEPS = 64


def _naive_bf16_rotate(band: torch.Tensor, delta: int, spec: RopeSpec) -> None:
    """What a rotation written in the cache dtype does: cos/sin and products in bf16."""
    angle = delta * spec.inv_freq_tensor()
    cos, sin = angle.cos().to(torch.bfloat16), angle.sin().to(torch.bfloat16)
    a, b = pair_views(band, spec.layout)
    new_a, new_b = a * cos - b * sin, b * cos + a * sin
    a.copy_(new_a)
    b.copy_(new_b)


def drift(steps: int, backend: str = "torch", rows: int = 256) -> tuple[float, float]:
    """(ours, naive) rel-L2 drift after ``steps`` rotations of a DeepSeek-V2-Lite k_pe band."""
    config = deepseek_v2_yarn(0.707, 0.707, betas=False)
    spec = RopeSpec.from_hf_config(config)
    g = torch.Generator().manual_seed(11)
    keys = torch.randn(rows, 64, generator=g, dtype=torch.float64)
    positions = torch.randint(0, 8192, (rows,), generator=g)
    stored = torch.stack(
        [
            rope_float64(keys[r], positions[r : r + 1], spec.inv_freq_tensor(), spec.layout)[0]
            for r in range(rows)
        ]
    ).to(torch.bfloat16)
    deltas = torch.randint(-512, 512, (steps,), generator=g).tolist()
    ours, naive = stored.clone()[None], stored.clone()
    idx = torch.arange(rows)
    for d in deltas:
        rotate_band(ours, idx, idx, d, spec, backend=backend)
        _naive_bf16_rotate(naive, d, spec)
    total = torch.tensor([sum(deltas)])
    exact = torch.stack(
        [
            rope_float64(stored[r].double(), total, spec.inv_freq_tensor(), spec.layout)[0]
            for r in range(rows)
        ]
    )

    def rel(x: torch.Tensor) -> float:
        return ((x.double() - exact).norm() / exact.norm()).item()

    return rel(ours[0]), rel(naive)


@pytest.mark.parametrize("steps", [1, STEPS])
def test_fp32_compute_drifts_no_more_than_bf16_compute(steps):
    ours, naive = drift(steps)
    print(f"bf16 drift after {steps} rotation(s): ours {ours:.3e}  naive {naive:.3e}")
    assert ours <= naive
    assert ours <= BF16_U * steps**0.5
    assert ours > 0  # the test can see rounding at all


def test_triton_drift_matches_torch():
    """Same drift through the interpreted Triton kernel (few rows, few steps)."""
    ours_triton, naive = drift(4, backend="triton", rows=32)
    ours_torch, _ = drift(4, backend="torch", rows=32)
    assert ours_triton <= naive
    assert ours_triton == pytest.approx(ours_torch, rel=0.01)
