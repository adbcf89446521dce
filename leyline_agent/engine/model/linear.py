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

oneDNN packs bf16 weights only on CPUs with AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT
(``torch.ops.mkldnn._is_mkldnn_bf16_supported``); elsewhere (an AVX2-only CPU) bf16 layers
get no packed copy: their forwards of up to ``skinny_linear.MAX_ROWS`` rows still take the C
kernel, larger ones ``F.linear``, and this is logged once.

Only inside the engine's forwards (an attention context is set): a plain forward of the same
model object, the tests' ground truth, runs transformers' ``nn.Linear`` unchanged. Each layer
keeps its weight and gets a packed copy (a second copy of every linear weight in memory);
the copy is rebuilt if the weight is changed in place afterwards (its version counter moved).
"""

from __future__ import annotations

import os
import types
from typing import Any

import structlog
import torch
import torch.nn.functional as F

from leyline_agent.engine.model.context import current
from leyline_agent.kernels import skinny_linear

__all__ = ["KERNEL_DTYPES", "PACKED_MIN_ROWS", "install_packed", "packed_available", "packs"]

# rows per forward from which the packed weight is used, by dtype (see above)
PACKED_MIN_ROWS = {torch.float32: 4, torch.bfloat16: 1}
# weight dtypes whose forwards of at most skinny_linear.MAX_ROWS rows take the C kernel
KERNEL_DTYPES = (torch.bfloat16,)
USE_LINEAR_KERNEL = os.environ.get("LEYLINE_LINEAR_KERNEL", "1") != "0"
_BATCH_HINT = 8  # the rows oneDNN chooses its blocking for (the decode batches it serves)

log = structlog.get_logger(__name__)


def packed_available(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN packing applies: CPU, a packed dtype, and torch built with mkldnn."""
    return (
        device.type == "cpu" and dtype in PACKED_MIN_ROWS and torch.backends.mkldnn.is_available()
    )


def packs(dtype: torch.dtype) -> bool:
    """Can oneDNN pack weights of ``dtype`` on this CPU (bf16 needs AVX-512 or NE-CONVERT)?"""
    if dtype is torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return dtype in PACKED_MIN_ROWS


def install_packed(model: Any) -> int:
    """Give every ``nn.Linear`` of ``model`` the engine's forward and, where oneDNN can pack
    its dtype here, a packed weight (idempotent); the number of layers given the forward."""
    n, unpacked = 0, 0
    for mod in model.modules():
        linear = isinstance(mod, torch.nn.Linear) and mod.weight.dtype in PACKED_MIN_ROWS
        if linear and not hasattr(mod, "_leyline_packed"):
            if packs(mod.weight.dtype):
                _pack(mod)
            else:
                mod._leyline_packed = None
                unpacked += 1
            mod.forward = types.MethodType(_packed_forward, mod)
            n += 1
    if unpacked:
        log.warning(
            "oneDNN cannot pack bf16 weights on this CPU (no AVX-512 / AVX-NE-CONVERT): "
            "bf16 forwards of more than a few rows use F.linear",
            layers=unpacked, cpu=torch.backends.cpu.get_cpu_capability(),
        )
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
    if self._leyline_packed is None or x.numel() < PACKED_MIN_ROWS[w.dtype] * x.shape[-1]:
        return F.linear(x, w, self.bias)
    packed, version = self._leyline_packed
    if version != w._version:  # the weight changed in place: repack
        packed = _pack(self)
    return torch.ops.mkldnn._linear_pointwise(x, packed, self.bias, "none", [], "")
