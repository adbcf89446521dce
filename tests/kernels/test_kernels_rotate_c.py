"""The C rotation backend (kernels/rotate_band.c) against the torch reference, bitwise.

The reference's own exactness (against float64 RoPE and Hugging Face's rotary code) is
tests/kernels/test_kernels_exactness.py, which runs the C backend too; here: every shape the
kernel takes gives the reference's bits, and the plans it does not take go to the
reference."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from leyline_agent.kernels import LAUNCHES, RopeSpec, plan_rotation, rotate_band, rotate_band_c
from leyline_agent.kernels.plan import resolve_backend


def _spec(half: int, layout: str) -> RopeSpec:
    freqs = (10000.0 ** -(torch.arange(half, dtype=torch.float32) / half)).tolist()
    return RopeSpec(inv_freq=tuple(freqs), rotary_dim=2 * half, layout=layout)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


def _both(buf, src, dst, delta, spec, offset):
    ref, ours = buf.clone(), buf.clone()
    rotate_band(ref, src, dst, delta, spec, offset, backend="torch")
    n = LAUNCHES.c
    rotate_band(ours, src, dst, delta, spec, offset, backend="c")
    assert LAUNCHES.c == n + 1  # the kernel ran, not the reference
    return ref, ours


@pytest.fixture(autouse=True)
def _built():
    assert rotate_band_c.available(), rotate_band_c.build_error()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("uniform", [True, False])
def test_equals_the_reference_bitwise(dtype, layout, uniform):
    g = torch.Generator().manual_seed(1)
    buf = ((torch.rand(2, 3, 300, 40, generator=g) * 2 - 1) * 50).to(dtype)
    src = torch.cat([torch.arange(0, 60), torch.arange(200, 230)])  # 60 moved, 30 in place
    dst = torch.cat([torch.arange(100, 160), torch.arange(200, 230)])
    delta = -240 if uniform else torch.randint(-5000, 5000, (90,), generator=g)
    ref, ours = _both(buf, src, dst, delta, _spec(8, layout), 12)
    assert torch.equal(_bits(ref), _bits(ours))
    assert not torch.equal(ref, buf)


@pytest.mark.parametrize("threads", [1, 2])
def test_pool_layouts_and_threads(threads, monkeypatch):
    """Lead dims with any strides (SGLang's [rows, heads, dim] pool seen as [heads, rows,
    dim]; an engine pool [layers, heads, slots, dim]), enough rows that threads share them."""
    monkeypatch.setattr(rotate_band_c, "PARALLEL_MIN", 1 << 12)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(2)
        spec = _spec(16, "half")
        pool = torch.rand(700, 4, 64, generator=g).transpose(0, 1)  # [heads, rows, dim] view
        ref, ours = _both(pool, torch.arange(0, 300), torch.arange(350, 650), 77, spec, 0)
        assert torch.equal(ref, ours)
        eng = torch.rand(3, 2, 900, 64, generator=g).bfloat16()
        ref, ours = _both(eng, torch.arange(100, 500), torch.arange(500, 900), -999, spec, 0)
        assert torch.equal(_bits(ref), _bits(ours))
    finally:
        torch.set_num_threads(old)


def test_plans_it_does_not_take_go_to_the_reference():
    g = torch.Generator().manual_seed(3)
    spec = _spec(4, "half")
    # a destination that another item reads: the sources must be gathered first
    buf = torch.rand(2, 20, 8, generator=g)
    src, dst = torch.tensor([1, 2, 3]), torch.tensor([2, 9, 10])
    assert plan_rotation(buf, src, dst, 5, spec).gather_first
    ref = buf.clone()
    rotate_band(ref, src, dst, 5, spec, backend="torch")
    before = (LAUNCHES.c, LAUNCHES.torch)
    rotate_band(buf, src, dst, 5, spec, backend="c")
    assert (LAUNCHES.c, LAUNCHES.torch) == (before[0], before[1] + 1)
    assert torch.equal(buf, ref)
    half = torch.rand(2, 20, 8, generator=g).half()  # fp16: the reference too
    before = (LAUNCHES.c, LAUNCHES.torch)
    rotate_band(half, [0], [5], 3, spec, backend="c")
    assert (LAUNCHES.c, LAUNCHES.torch) == (before[0], before[1] + 1)


def test_launcher_refuses_a_gathering_plan_and_writes_nothing():
    spec = _spec(4, "half")
    buf = torch.rand(20, 8)
    plan = plan_rotation(buf, [1, 2], [2, 9], 5, spec, backend="c")
    before = buf.clone()
    with pytest.raises(ValueError, match="gather_first True"):
        rotate_band_c.rotate_band_c(buf, plan, spec)
    assert torch.equal(_bits(buf), _bits(before))


def test_c_backend_is_for_cpu_buffers_only(monkeypatch):
    """(No GPU here: the choice for a CUDA buffer, which planning makes before any write.)"""
    monkeypatch.delenv("LEYLINE_KERNEL", raising=False)
    assert resolve_backend(torch.device("cpu"), None) == "c"
    assert resolve_backend(torch.device("cuda"), None) == "triton"
    with pytest.raises(ValueError, match="backend='c' runs on CPU buffers only"):
        resolve_backend(torch.device("cuda"), "c")


def test_without_a_compiler_cpu_buffers_take_the_reference(tmp_path):
    env = dict(os.environ, CC=str(tmp_path / "no-such-cc"), LEYLINE_KERNEL_CACHE=str(tmp_path))
    env.pop("LEYLINE_KERNEL", None)
    code = (
        "import torch\n"
        "from leyline_agent.kernels import LAUNCHES, RopeSpec, rotate_band, rotate_band_c\n"
        "spec = RopeSpec(inv_freq=(1.0, 0.5), rotary_dim=4, layout='half')\n"
        "buf = torch.rand(6, 8)\n"
        "rotate_band(buf, [0], [3], 2, spec)\n"
        "assert not rotate_band_c.available() and (LAUNCHES.c, LAUNCHES.torch) == (0, 1)\n"
        "print(rotate_band_c.build_error())\n"
    )
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "rotate_band.c did not build" in r.stdout
