"""Decode attention for a batch of sequences over their pool rows (CPU; pool fp32 or bf16,
arithmetic in fp32): a C kernel, its launcher and its torch reference.

Shapes (S decoding sequences, one query token each; B heads of keys, g query rows per
head; P key parts)::

    qs[p]       [S, B, g, d_p]   the queries' share of key part p (last dim contiguous)
    k_pools[p]  [B, slots, d_p]  key part p of the pool (one layer)
    v_pool      [B, slots, dv]   the values of the pool (one layer)
    runs[s]     ((first, length), ...)  sequence s's rows: runs of consecutive slots
    -> out      [S, B, g, dv]    softmax(scale * sum_p qs[p] . k_p^T) . v over its rows

GQA: one key part, B = kv heads, g = query heads per kv head. MLA in latent space: B = 1
(the latent head), g = query heads, key parts ``c_kv`` (against the absorbed query) and
``k_pe`` (against the rotated query), values ``c_kv`` again.

One call per layer serves every decoding sequence (``decode_attn.c``): per (sequence, head,
group of query rows) the scores go to a scratch row, are exponentiated against their
maximum, and weight the values; long sequences are split into shares merged by their
maxima and sums (flash-decoding's split-K), so that one sequence keeps every thread busy.
No row is copied out of the pool. Why a kernel: torch's CPU flash attention takes a 4-row
query against 8k rows at a third to half of this machine's read bandwidth (small GEMMs per
512-row block), and at batch 8 x 512 rows the per-sequence torch ops cost more than their
arithmetic (docs/measurements.md, ``leyline bench engine``).

The C file is compiled on first use (``cbuild.py``: the system's C compiler, ``-O3
-march=native -fopenmp``, cached per source, compiler and CPU); its OpenMP runtime is the
one torch loaded, so the two share one thread pool. ``available()`` says whether it built
(``build_error()`` why not); without it the engine keeps its torch paths.
"""

from __future__ import annotations

import ctypes
from array import array
from collections.abc import Sequence
from pathlib import Path

import torch

from leyline_agent.kernels import cbuild

__all__ = ["available", "build_error", "decode_attention", "decode_attention_torch", "fits"]

_SOURCE = Path(__file__).with_name("decode_attn.c")
_VEC = 16  # floats per vector in the kernel: every width must be a multiple
_MAX_PARTS = 2
_POOL_DTYPES = (torch.float32, torch.bfloat16)
# below this many rows (all sequences, all heads) one thread does it all: waking the other
# threads costs more than the rows (measured: batch 8 x 512 rows, mini MLA)
PARALLEL_MIN_ROWS = 256
# a (sequence, head, group) is split into shares of at least this many rows
SPLIT_MIN_ROWS = 256

Runs = Sequence[tuple[int, int]]


def decode_attention(
    qs: Sequence[torch.Tensor],
    k_pools: Sequence[torch.Tensor],
    v_pool: torch.Tensor,
    runs: Sequence[Runs],
    scale: float,
) -> torch.Tensor:
    """Attention of each sequence's queries over its runs (shapes: module docstring). The C
    kernel; raises ValueError on inputs it does not take (``fits`` says beforehand)."""
    _check(qs, k_pools, v_pool, runs)
    lib = _LIB.get()
    if lib is None:
        raise RuntimeError(build_error())
    if not _fits(qs, k_pools, v_pool):
        raise ValueError("decode_attention: inputs the kernel does not take (see fits)")
    S, B, g = qs[0].shape[:3]
    dv = v_pool.shape[-1]
    qs = [q.float() for q in qs]  # the kernel's arithmetic is fp32 (a bf16 query: a copy)
    seq_runs, firsts, lens = array("q", [0]), array("q"), array("q")
    longest = 0
    for r in runs:
        firsts.extend(f for f, _ in r)
        lens.extend(n for _, n in r)
        seq_runs.append(len(lens))
        longest = max(longest, sum(n for _, n in r))
    threads = torch.get_num_threads()
    groups = -(-g // (8 if g % 8 == 0 else 4))
    tasks = S * B * groups
    splits = max(1, min(-(-threads // tasks), longest // SPLIT_MIN_ROWS)) if tasks < threads else 1
    out = torch.empty(S, B, g, dv, dtype=torch.float32)
    P = len(qs)
    i32 = array("i", [q.shape[-1] for q in qs])
    qa = [array("q", v) for v in zip(*[(q.data_ptr(), *q.stride()[:3]) for q in qs], strict=True)]
    ka = [
        array("q", v) for v in zip(*[(k.data_ptr(), *k.stride()[:2]) for k in k_pools], strict=True)
    ]
    rc = lib.ll_decode(
        S, B, g, P, _addr(i32), dv, *(_addr(a) for a in qa), *(_addr(a) for a in ka),
        v_pool.data_ptr(), v_pool.stride(0), v_pool.stride(1),
        _addr(seq_runs), _addr(firsts), _addr(lens),
        out.data_ptr(), out.stride(0), out.stride(1), out.stride(2),
        splits, scale, threads, PARALLEL_MIN_ROWS, int(v_pool.dtype == torch.bfloat16),
    )  # fmt: skip
    if rc != 0:
        raise MemoryError("decode_attention: the kernel's scratch memory could not be allocated")
    return out


def decode_attention_torch(
    qs: Sequence[torch.Tensor],
    k_pools: Sequence[torch.Tensor],
    v_pool: torch.Tensor,
    runs: Sequence[Runs],
    scale: float,
) -> torch.Tensor:
    """The reference (any dtype or device), sequence by sequence: its rows gathered, one
    softmax, in fp32."""
    _check(qs, k_pools, v_pool, runs)
    outs = []
    for s, r in enumerate(runs):
        idx = torch.cat([torch.arange(f, f + n) for f, n in r]).to(v_pool.device)
        scores = sum(
            torch.matmul(q[s].float(), k.index_select(1, idx).float().transpose(1, 2))
            for q, k in zip(qs, k_pools, strict=True)
        )
        prob = torch.softmax(scores * scale, dim=-1)
        outs.append(torch.matmul(prob, v_pool.index_select(1, idx).float()))
    return torch.stack(outs)


def fits(qs: Sequence[torch.Tensor], k_pools: Sequence[torch.Tensor], v_pool: torch.Tensor) -> bool:
    """Whether ``decode_attention`` takes these inputs: the kernel built, on CPU, pools all
    fp32 or all bf16 (queries fp32 or bf16), last dims contiguous and multiples of 16, at
    most two key parts."""
    return available() and _fits(qs, k_pools, v_pool)


# ------------------------------------------------------------------------------ launcher
def _addr(a: array) -> int:
    return a.buffer_info()[0]


def _check(
    qs: Sequence[torch.Tensor],
    k_pools: Sequence[torch.Tensor],
    v_pool: torch.Tensor,
    runs: Sequence[Runs],
) -> None:
    """Shapes and rows agree (ValueError naming the argument)."""
    if not qs or len(qs) != len(k_pools):
        raise ValueError(f"decode_attention: qs: {len(qs)} parts for {len(k_pools)} key parts")
    if qs[0].dim() != 4:
        raise ValueError(f"decode_attention: qs[0]: shape {tuple(qs[0].shape)}, want [S, B, g, d]")
    S, B, g = qs[0].shape[:3]
    if v_pool.dim() != 3 or v_pool.shape[0] != B:
        raise ValueError(
            f"decode_attention: v_pool: shape {tuple(v_pool.shape)}, want [{B}, slots, dv]"
        )
    slots = v_pool.shape[1]
    for p, (q, k) in enumerate(zip(qs, k_pools, strict=True)):
        if q.dim() != 4 or tuple(q.shape[:3]) != (S, B, g):
            raise ValueError(
                f"decode_attention: qs[{p}]: shape {tuple(q.shape)}, want [{S}, {B}, {g}, d]"
            )
        if k.dim() != 3 or tuple(k.shape) != (B, slots, q.shape[3]):
            raise ValueError(
                f"decode_attention: k_pools[{p}]: shape {tuple(k.shape)}, "
                f"want [{B}, {slots}, {q.shape[3]}]"
            )
    if len(runs) != S:
        raise ValueError(f"decode_attention: runs: {len(runs)} sequences, qs has {S}")
    for s, r in enumerate(runs):
        if not r:
            raise ValueError(f"decode_attention: runs[{s}]: no rows")
        for f, n in r:
            if n <= 0 or f < 0 or f + n > slots:
                raise ValueError(f"decode_attention: runs[{s}]: run ({f}, {n}) outside 0..{slots}")


def _fits(
    qs: Sequence[torch.Tensor], k_pools: Sequence[torch.Tensor], v_pool: torch.Tensor
) -> bool:
    tensors = [*qs, *k_pools, v_pool]
    if len(qs) > _MAX_PARTS or any(t.device.type != "cpu" for t in tensors):
        return False
    if v_pool.dtype not in _POOL_DTYPES or any(k.dtype != v_pool.dtype for k in k_pools):
        return False
    if any(q.dtype not in _POOL_DTYPES for q in qs):
        return False
    return not any(t.stride(-1) != 1 or t.shape[-1] % _VEC for t in tensors)


# ------------------------------------------------------------------------------ building
def available() -> bool:
    """Whether the C kernel is built and loaded on this machine."""
    return _LIB.get() is not None


def build_error() -> str | None:
    """Why the kernel is not available (None if it is)."""
    return _LIB.error


def _declare(lib: ctypes.CDLL) -> None:
    i, i64, p, f = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    lib.ll_decode.argtypes = [
        i, i, i, i, p, i,  # nseq, B, g, nparts, d, dv
        p, p, p, p, p, p, p,  # q ptrs / seq, head, row strides; k ptrs / head, row strides
        i64, i64, i64,  # v ptr, head, row stride
        p, p, p,  # seq_runs, run_first, run_len
        i64, i64, i64, i64,  # o ptr, seq, head, row stride
        i, f, i, i64, i,  # splits, scale, nthreads, parallel_min_rows, kv_bf16
    ]  # fmt: skip
    lib.ll_decode.restype = i


_LIB = cbuild.Library(_SOURCE, _declare)
