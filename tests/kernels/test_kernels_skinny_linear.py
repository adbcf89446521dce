"""kernels/skinny_linear.c against an independent computation: a float64 product of the same
(fp32 or bf16) values, for the row counts a decode step gives it (1-4), widths that are and
are not multiples of 16, output counts below, at and off its four streams, strided rows,
with and without bias, one and two threads (two: a weight above its parallel threshold)."""

from __future__ import annotations

import pytest
import torch

from leyline_agent.kernels import skinny_linear as sl


def _truth(x, w, bias):
    y = x.double() @ w.double().T
    return y if bias is None else y + bias.double()


def _close(got, truth, dtype):
    """fp32: summation order only; bf16 output: one rounding of the fp32 sum."""
    err = (got.double() - truth).abs()
    if dtype is torch.float32:
        return bool((err <= 1e-5 * (1 + truth.abs())).all())
    return bool((err <= 2**-8 * truth.abs() + 1e-2).all())


def test_the_kernel_builds_here():
    assert sl.available(), sl.build_error()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize(("out", "n"), [(80, 96), (3, 64), (1027, 48), (7, 33), (1030, 304)])
def test_rows_1_to_4_equal_float64(threads, dtype, bias, out, n):
    g = torch.Generator().manual_seed(out * n)
    w = torch.randn(out, n, generator=g).to(dtype)
    b = torch.randn(out, generator=g).to(dtype) if bias else None
    for rows in range(1, sl.MAX_ROWS + 1):
        x = torch.randn(1, rows, n, generator=g).to(dtype)
        assert sl.fits(x, w, b)
        got = sl.linear(x, w, b)
        assert got.shape == (1, rows, out) and got.dtype == dtype
        assert _close(got, _truth(x, w, b), dtype), rows


def test_a_weight_above_the_parallel_threshold_is_cut_between_threads(threads):
    """Enough elements that two threads each take a range of output rows."""
    out, n = 2051, 256
    assert out * n >= sl.PARALLEL_MIN
    g = torch.Generator().manual_seed(4)
    w, x = torch.randn(out, n, generator=g), torch.randn(3, n, generator=g)
    assert _close(sl.linear(x, w), _truth(x, w, None), torch.float32)


def test_strided_rows_of_x_and_w():
    """Row strides other than the width (views into wider tensors) are read through."""
    g = torch.Generator().manual_seed(5)
    wide_w, wide_x = torch.randn(300, 160, generator=g), torch.randn(3, 200, generator=g)
    w, x = wide_w[::2, 16:80], wide_x[:, 32:96]
    assert w.stride(0) != w.shape[1] and x.stride(0) != x.shape[1]
    assert _close(sl.linear(x, w), _truth(x, w, None), torch.float32)


def test_the_torch_reference_is_the_same_product():
    g = torch.Generator().manual_seed(6)
    w, x, b = torch.randn(40, 48, generator=g), torch.randn(2, 48, generator=g), torch.randn(40)
    assert _close(sl.linear_torch(x, w, b), _truth(x, w, b), torch.float32)


@pytest.mark.parametrize(
    ("x_shape", "w_shape", "b_shape", "field"),
    [
        ((2, 48), (40,), None, "w"),
        ((2, 47), (40, 48), None, "x"),
        ((2, 48), (40, 48), (41,), "bias"),
    ],
)
def test_bad_input_names_the_argument(x_shape, w_shape, b_shape, field):
    x, w = torch.randn(x_shape), torch.randn(w_shape)
    b = None if b_shape is None else torch.randn(b_shape)
    with pytest.raises(ValueError, match=rf"skinny_linear: {field}: "):
        sl.linear(x, w, b)


def test_inputs_it_does_not_take_are_said_by_fits():
    w, x = torch.randn(40, 48), torch.randn(2, 48)
    assert sl.fits(x, w)
    assert not sl.fits(torch.randn(sl.MAX_ROWS + 1, 48), w)  # too many rows
    assert not sl.fits(x.half(), w.half())  # fp16
    assert not sl.fits(x, torch.randn(48, 40).T)  # weight columns not contiguous
    assert not sl.fits(torch.randn(48, 2).T, w)  # x's last dim not contiguous
    with pytest.raises(ValueError, match="does not take"):
        sl.linear(torch.randn(sl.MAX_ROWS + 1, 48), w)
