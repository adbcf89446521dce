"""Random src/dst/delta (overlapping, repeated sources, mixed in-place and moved rows) against
a row-by-row float64 oracle of the contract: every destination gets R(delta) of its source
row as it was BEFORE the call; rows that are no destination keep their bytes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from leyline_agent.kernels import RopeSpec, rotate_band
from leyline_agent.kernels.reference import rope_float64


@st.composite
def calls(draw):
    rows = draw(st.integers(1, 40))
    k = draw(st.integers(0, rows))
    dst = draw(st.permutations(range(rows)))[:k]
    src = [draw(st.integers(0, rows - 1)) for _ in range(k)]
    if draw(st.booleans()):  # make some items in place
        src = [d if draw(st.booleans()) else s for s, d in zip(src, dst, strict=True)]
    delta = [draw(st.integers(-5000, 5000)) for _ in range(k)]
    layout = draw(st.sampled_from(["interleaved", "half"]))
    half = draw(st.integers(1, 5))
    offset = draw(st.integers(0, 3))
    width = offset + 2 * half + draw(st.integers(0, 3))
    seed = draw(st.integers(0, 2**16))
    return rows, src, dst, delta, layout, half, offset, width, seed


def _check(call, backend: str) -> None:
    rows, src, dst, delta, layout, half, offset, width, seed = call
    freqs = tuple(float(torch.tensor(0.7**j, dtype=torch.float32)) for j in range(half))
    spec = RopeSpec(inv_freq=freqs, rotary_dim=2 * half, layout=layout)
    g = torch.Generator().manual_seed(seed)
    before = torch.rand(2, rows, width, generator=g) * 2 - 1
    buf = before.clone()
    rotate_band(
        buf, src, dst, torch.tensor(delta, dtype=torch.int64), spec, offset, backend=backend
    )
    expected = before.double().clone()
    for s, d, dl in zip(src, dst, delta, strict=True):
        for h in range(2):
            expected[h, d] = rope_float64(
                before[h, s], torch.tensor([dl]), spec.inv_freq_tensor(), layout, offset
            )[0]
    assert (buf.double() - expected).abs().max().item() <= 1e-5
    untouched = [r for r in range(rows) if r not in set(dst)]
    assert torch.equal(buf[:, untouched], before[:, untouched])


@pytest.mark.parametrize("backend,examples", [("torch", 60), ("triton", 15), ("c", 60)])
def test_random_calls_match_row_by_row_oracle(backend, examples):
    @settings(max_examples=examples, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(calls())
    def run(call):
        _check(call, backend)

    run()
