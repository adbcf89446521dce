"""The model's ``nn.Linear`` layers on oneDNN-packed weights, for the engine's batched forwards
(and a C kernel for few-row bf16 products).

A decode step of eight sequences is a GEMM with eight rows per weight matrix. On CPU, the
default path (``F.linear``: MKL's sgemm) runs such few-row products well below the
machine's arithmetic speed, although each weight is read once for all rows. A weight
reordered once into oneDNN's blocked layout (``torch.ops.mkldnn._reorder_linear_weight``,
what inductor's CPU freezing pass does) runs them faster. In fp32 the packed product is
slower for a row or two, so fp32 forwards of fewer than ``PACKED_MIN_ROWS`` rows keep
``F.linear``; in bf16 it is never slower. bf16 forwards of at most ``skinny_linear.MAX_ROWS`` rows (a decode
step of up to four sequences) take ``kernels/skinny_linear.c`` instead: it reads the bf16
weights near the machine's bandwidth, which oneDNN's and MKL's few-row bf16 products do
not. In fp32 MKL already reads at bandwidth, so fp32 keeps ``F.linear``.
``LEYLINE_LINEAR_KERNEL=0`` switches the kernel off (benchmarks' A/B). ``leyline bench
engine --runner`` and ``--dtype bfloat16`` measure each choice side by side
(docs/measurements.md).

Only inside the engine's forwards (an attention context is set): a plain forward of the same
model object, the tests' ground truth, runs transformers' ``nn.Linear`` unchanged. Each layer
keeps its weight and gets a packed copy (a second copy of every linear weight in memory);
the copy is rebuilt if the weight is changed in place afterwards (its version counter moved).
"""

from __future__ import annotations

import os
import types
from typing import Any

import torch
import torch.nn.functional as F

from leyline_agent.engine.model.context import current
from leyline_agent.kernels import skinny_linear

__all__ = ["KERNEL_DTYPES", "PACKED_MIN_ROWS", "install_packed", "packed_available"]

# rows per forward from which the packed weight is used, by dtype (see above)
PACKED_MIN_ROWS = {torch.float32: 4, torch.bfloat16: 1}
# weight dtypes whose forwards of at most skinny_linear.MAX_ROWS rows take the C kernel
KERNEL_DTYPES = (torch.bfloat16,)
USE_LINEAR_KERNEL = os.environ.get("LEYLINE_LINEAR_KERNEL", "1") != "0"
_BATCH_HINT = 8  # the rows oneDNN chooses its blocking for (the decode batches it serves)


def packed_available(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN packing applies: CPU, a packed dtype, and torch built with mkldnn."""
    return (
        device.type == "cpu" and dtype in PACKED_MIN_ROWS and torch.backends.mkldnn.is_available()
    )


def install_packed(model: Any) -> int:
    """Give every ``nn.Linear`` of ``model`` a packed weight for the engine's forwards
    (idempotent); the number of layers packed."""
    n = 0
    for mod in model.modules():
        linear = isinstance(mod, torch.nn.Linear) and mod.weight.dtype in PACKED_MIN_ROWS
        if linear and not hasattr(mod, "_leyline_packed"):
            _pack(mod)
            mod.forward = types.MethodType(_packed_forward, mod)
            n += 1
    return n


def _pack(mod: Any) -> torch.Tensor:
    packed = torch.ops.mkldnn._reorder_linear_weight(mod.weight.detach(), _BATCH_HINT)
    mod._leyline_packed = (packed, mod.weight._version)
    return packed


def _packed_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    w = self.weight
    if current() is None or x.dtype != w.dtype:
        return F.linear(x, w, self.bias)
    if USE_LINEAR_KERNEL and w.dtype in KERNEL_DTYPES and skinny_linear.fits(x, w, self.bias):
        return skinny_linear.linear(x, w, self.bias)
    if x.numel() < PACKED_MIN_ROWS[w.dtype] * x.shape[-1]:
        return F.linear(x, w, self.bias)
    packed, version = self._leyline_packed
    if version != w._version:  # the weight changed in place: repack
        packed = _pack(self)
    return torch.ops.mkldnn._linear_pointwise(x, packed, self.bias, "none", [], "")
