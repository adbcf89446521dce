"""A linear layer for a few rows, read at the machine's bandwidth (CPU; weights fp32 or bf16,
arithmetic in fp32): a C kernel, its launcher and its torch reference.

Shapes::

    x     [..., n]   at most MAX_ROWS rows in all (fp32 or bf16; last dim contiguous)
    w     [out, n]   fp32 or bf16, last dim contiguous
    bias  [out] or None
    -> y  [..., out] in x's dtype:  x @ w.T + bias, summed in fp32

A decode step of one or a few sequences is this product for every linear layer of the model:
each weight is read once per step, so the step's time is the weights' read. The kernel
(``skinny_linear.c``) reads NS interleaved streams of weight rows with a software prefetch;
threads take contiguous ranges of output rows. Where it pays: bf16 weights, whose few-row
products oneDNN and MKL run well below the read bandwidth (``leyline bench engine --dtype
bfloat16`` measures it against oneDNN's packed product, its "oneDNN linear" column). In
fp32 MKL already reads at bandwidth, so the engine keeps ``F.linear`` there
(``engine/model/linear.py``).

Built on first use (``cbuild.py``); ``available()`` says whether it built, ``build_error()``
why not; without it the engine keeps its oneDNN and MKL products.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch
import torch.nn.functional as F

from leyline_agent.kernels import cbuild

__all__ = ["MAX_ROWS", "available", "build_error", "fits", "linear", "linear_torch"]

_SOURCE = Path(__file__).with_name("skinny_linear.c")
MAX_ROWS = 4  # rows per call (the C file's MAX_ROWS: M x 4 accumulators in registers)
_DTYPES = (torch.float32, torch.bfloat16)
# weights of fewer elements stay on one thread (waking the others costs more than the rows)
PARALLEL_MIN = 1 << 18


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w.T + bias`` by the C kernel (shapes: module docstring); raises ValueError
    naming the argument on inputs it does not take (``fits`` says beforehand)."""
    _check(x, w, bias)
    lib = _LIB.get()
    if lib is None:
        raise RuntimeError(build_error())
    if not _fits(x, w, bias):
        raise ValueError("skinny_linear: inputs the kernel does not take (see fits)")
    n, out = w.shape[1], w.shape[0]
    x2 = x.reshape(-1, n).float()
    b = None if bias is None else bias.float().contiguous()
    y = torch.empty(x2.shape[0], out, dtype=torch.float32)
    rc = lib.ll_linear(
        x2.shape[0], n, out, x2.data_ptr(), x2.stride(0), w.data_ptr(), w.stride(0),
        int(w.dtype == torch.bfloat16), 0 if b is None else b.data_ptr(),
        y.data_ptr(), y.stride(0), torch.get_num_threads(), PARALLEL_MIN,
    )  # fmt: skip
    if rc != 0:
        raise ValueError(f"skinny_linear: x: {x2.shape[0]} rows, at most {MAX_ROWS}")
    return y.to(x.dtype).view(*x.shape[:-1], out)


def linear_torch(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The reference (any device): ``F.linear`` in fp32, cast back to x's dtype."""
    _check(x, w, bias)
    b = None if bias is None else bias.float()
    return F.linear(x.float(), w.float(), b).to(x.dtype)


def fits(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether ``linear`` takes these inputs: the kernel built, CPU tensors, x of at most
    ``MAX_ROWS`` rows with its last dim contiguous, w fp32 or bf16 with contiguous rows."""
    return available() and _fits(x, w, bias)


def available() -> bool:
    """Whether the C kernel is built and loaded on this machine."""
    return _LIB.get() is not None


def build_error() -> str | None:
    """Why the kernel is not available (None if it is)."""
    return _LIB.error


# ------------------------------------------------------------------------------ launcher
def _check(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> None:
    """Shapes agree (ValueError naming the argument)."""
    if w.dim() != 2:
        raise ValueError(f"skinny_linear: w: shape {tuple(w.shape)}, want [out, n]")
    if x.dim() < 1 or x.shape[-1] != w.shape[1]:
        raise ValueError(f"skinny_linear: x: shape {tuple(x.shape)}, want [..., {w.shape[1]}]")
    if bias is not None and tuple(bias.shape) != (w.shape[0],):
        raise ValueError(f"skinny_linear: bias: shape {tuple(bias.shape)}, want [{w.shape[0]}]")


def _fits(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> bool:
    tensors = [x, w] if bias is None else [x, w, bias]
    if any(t.device.type != "cpu" for t in tensors):
        return False
    if x.dtype not in _DTYPES or w.dtype not in _DTYPES or w.stride(1) != 1:
        return False
    return 0 < x.numel() <= MAX_ROWS * w.shape[1] and x.stride(-1) == 1


def _declare(lib: ctypes.CDLL) -> None:
    i, i64 = ctypes.c_int, ctypes.c_int64
    lib.ll_linear.argtypes = [
        i, i64, i64,  # M, n, out
        i64, i64, i64, i64, i,  # x ptr, x row stride, w ptr, w row stride, w bf16
        i64, i64, i64,  # bias ptr (0: none), y ptr, y row stride
        i, i64,  # nthreads, parallel_min
    ]  # fmt: skip
    lib.ll_linear.restype = i


_LIB = cbuild.Library(_SOURCE, _declare)
