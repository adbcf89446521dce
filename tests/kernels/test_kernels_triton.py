"""The Triton kernel (interpreted on CPU) against the torch reference, and backend dispatch.

Shapes stay small: the interpreter costs ~1 ms per program instance.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import triton

from leyline_agent.kernels import LAUNCHES, RopeSpec, rotate_band

pytestmark = pytest.mark.slow

# Values of one dtype ulp (relative) at most: fp32 results that differ in the last bit can
# round to neighbouring bf16/fp16 values.
ULP = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}


def _spec(half: int, layout: str, seed: int = 0) -> RopeSpec:
    g = torch.Generator().manual_seed(seed)
    freqs = (10000.0 ** -(torch.arange(half, dtype=torch.float32) / half)) * (
        1 + 0.1 * torch.rand(half, generator=g)
    )
    return RopeSpec(
        inv_freq=tuple(freqs.tolist()), rotary_dim=2 * half, layout=layout, model_type=None
    )


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


def _pair(buffer_fn, src, dst, delta, spec, band_offset):
    out = {}
    for backend in ("torch", "triton"):
        base, view = buffer_fn()
        rotate_band(view, src, dst, delta, spec, band_offset, backend=backend)
        out[backend] = base
    return out["torch"], out["triton"]


LAYOUTS = ["interleaved", "half"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "mode", ["in_place", "copy", "overlap", "mixed"], ids=lambda m: f"mode={m}"
)
def test_triton_equals_torch_reference(layout, dtype, mode):
    g = torch.Generator().manual_seed(7)
    rows, width, half, band_offset, k = 40, 100, 5, 37, 13  # odd sizes: masks everywhere
    spec = _spec(half, layout)
    original = (torch.rand(3, rows, width, generator=g) * 2 - 1).to(dtype)
    src = torch.randperm(rows, generator=g)[:k]
    if mode == "in_place":
        dst = src
    elif mode == "copy":  # disjoint destinations
        rest = torch.tensor([r for r in range(rows) if r not in set(src.tolist())])
        dst = rest[:k]
    elif mode == "overlap":  # destinations are other items' sources
        dst = src.roll(1)
    else:  # some in place, some moved onto other sources
        dst = torch.cat([src[:5], src[5:].roll(1)])
    delta = torch.randint(-3000, 3000, (k,), generator=g)

    def fresh():
        b = original.clone()
        return b, b

    ref, tri = _pair(fresh, src, dst, delta, spec, band_offset)
    band = slice(band_offset, band_offset + spec.rotary_dim)
    if dtype == torch.float32:
        assert (ref - tri).abs().max().item() <= 1e-6
    else:
        torch.testing.assert_close(tri, ref, atol=0, rtol=ULP[dtype])
    # Everything outside the destination bands is bitwise identical (copied bytes included).
    outside = torch.ones(rows, width, dtype=torch.bool)
    outside[dst[:, None], torch.arange(band.start, band.stop)[None, :]] = False
    assert torch.equal(_bits(ref)[:, outside], _bits(tri)[:, outside])
    # ... and equals the source row's bytes for moved rows, the original for all others.
    expected = _bits(original).clone()
    moved = src != dst
    expected[:, dst[moved]] = _bits(original)[:, src[moved]]
    assert torch.equal(_bits(tri)[:, outside], expected[:, outside])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_strided_views_write_through_to_storage(layout):
    """A [heads, rows, dim] transposed view of a [rows, heads, dim] pool, and a 4-D view whose
    lead dims cannot be collapsed (one launch per leading index)."""
    g = torch.Generator().manual_seed(3)
    spec = _spec(8, layout)
    pool = torch.rand(30, 4, 48, generator=g) * 2 - 1
    src, dst, delta = torch.tensor([1, 2, 3, 9]), torch.tensor([20, 2, 21, 1]), 77

    ref, tri = _pair(
        lambda: (lambda p: (p, p.transpose(0, 1)))(pool.clone()), src, dst, delta, spec, 16
    )
    assert (ref - tri).abs().max().item() <= 1e-6
    assert not torch.equal(ref, pool)  # the writes really landed in the pool

    pool4 = torch.rand(2, 30, 3, 40, generator=g) * 2 - 1  # [b, rows, heads, dim]

    def fresh4():
        p = pool4.clone()
        v = p.permute(2, 0, 1, 3)  # [heads, b, rows, dim]: lead dims (heads, b) don't collapse
        return p, v

    ref4, tri4 = _pair(fresh4, src, dst, torch.tensor([5, -5, 500, 0]), spec, 0)
    assert (ref4 - tri4).abs().max().item() <= 1e-6
    assert not torch.equal(ref4, pool4)


def test_empty_index_is_a_no_op():
    spec = _spec(4, "half")
    buf = torch.rand(5, 16)
    before = buf.clone()
    for backend in ("torch", "triton", "c"):
        rotate_band(buf, [], [], 3, spec, backend=backend)
    assert torch.equal(buf, before)


@pytest.mark.parametrize("env", ["triton", "torch", "c", ""])
def test_env_selects_backend(monkeypatch, env):
    """$LEYLINE_KERNEL picks the backend (unset: the C kernel on CPU, where it built);
    LAUNCHES counts real kernel launches / reference runs."""
    monkeypatch.setenv("LEYLINE_KERNEL", env)
    spec = _spec(4, "interleaved")
    buf = torch.rand(2, 12, 8)
    expect = buf.clone()
    rotate_band(expect, [0, 5], [0, 7], 11, spec, backend="torch")
    before = (LAUNCHES.triton, LAUNCHES.c, LAUNCHES.torch)
    rotate_band(buf, [0, 5], [0, 7], 11, spec)
    ran = (LAUNCHES.triton - before[0], LAUNCHES.c - before[1], LAUNCHES.torch - before[2])
    assert ran == {"triton": (1, 0, 0), "torch": (0, 0, 1)}.get(env, (0, 1, 0))
    assert (buf - expect).abs().max().item() <= 1e-6


def test_env_triton_in_fresh_interpreter_process():
    """A fresh process with TRITON_INTERPRET=1 and LEYLINE_KERNEL=triton runs the kernel."""
    code = textwrap.dedent(
        """
        import torch
        from leyline_agent.kernels import LAUNCHES, RopeSpec, rotate_band
        spec = RopeSpec(inv_freq=(1.0, 0.5), rotary_dim=4, layout="half")
        buf = torch.zeros(3, 6)
        buf[0, :4] = torch.tensor([1.0, 0.0, 0.0, 0.0])
        rotate_band(buf, [0], [2], 1, spec, band_offset=0)
        print(LAUNCHES.triton, LAUNCHES.torch, round(buf[2, 0].item(), 6),
              round(buf[2, 2].item(), 6))
        """
    )
    env = dict(os.environ, LEYLINE_KERNEL="triton", TRITON_INTERPRET="1")
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    n_triton, n_torch, a, b = out.stdout.split()
    assert (int(n_triton), int(n_torch)) == (1, 0)
    # R(1 rad) applied to the pair (1, 0): (cos 1, sin 1).
    assert float(a) == pytest.approx(0.540302, abs=1e-6)
    assert float(b) == pytest.approx(0.841471, abs=1e-6)


@pytest.mark.parametrize(
    "dtype,layout,copy_rows",
    [("*bf16", "interleaved", True), ("*fp32", "half", False)],
)
def test_kernel_compiles_for_cuda_sm90(tmp_path, monkeypatch, dtype, layout, copy_rows):
    """No GPU here: compile the same kernel ahead of time for an H100/H200 (sm_90) down to a
    cubin, so a typing or lowering error that the interpreter tolerates fails on CPU too."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from leyline_agent.kernels.rotate_band_triton import _compiled

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    ptr = {n: dtype for n in ("src_ptr", "dst_ptr")}
    i64 = {n: "i64" for n in ("n_items", "n_k", "src_stride_l", "src_stride_r")}
    signature = {
        **ptr,
        "src_rows_ptr": "*i64",
        "dst_rows_ptr": "*i64",
        "delta_ptr": "*i64",
        "moved_ptr": "*i8",
        "inv_freq_ptr": "*fp32",
        **i64,
        "dst_stride_l": "i64",
        "dst_stride_r": "i64",
        "width": "i32",
        "band_offset": "i32",
    }
    constexprs = dict(
        HALF=32,
        BLOCK_H=32,
        INTERLEAVED=layout == "interleaved",
        COPY_ROWS=copy_rows,
        BLOCK_R=16,
        BLOCK_W=128,
        OUT_BF16=dtype == "*bf16",
    )
    signature.update({name: "constexpr" for name in constexprs})
    src = ASTSource(_compiled, signature, constexprs=constexprs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32))
    assert compiled.asm["cubin"]
    # The angle really is reduced in fp64 and only then narrowed to fp32.
    assert "cvt.rn.f32.f64" in compiled.asm["ptx"]
