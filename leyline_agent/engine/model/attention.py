"""Attention owned by the engine: it writes new KV into the pool and reads rows by slot.

Shapes (one packed forward of N new tokens, ``context.py``; H query heads):

- GQA (Llama, Qwen3), through transformers' attention-function registry under the name
  ``leyline``: the module hands over post-RoPE ``query [1, H, N, d]``, ``key/value
  [1, KVH, N, d]``; they go to ``pool.keys/values[layer][:, slot_mapping]`` and each sequence
  attends over ``pool[layer][:, kv_slots]`` (a view when its slots are one run). On CPU a
  chunk after cached rows attends those unmasked, run by run, and its own rows causally,
  the parts merged by log-sum-exp (``_gqa_extend``): no ``[t, n]`` mask.
- MLA (DeepSeek V2/V3), a replaced ``forward`` of each attention module: the module's own
  projections, norm and rotary function give ``q_nope [H, N, nope]``, ``q_pe [H, N, rope]``,
  ``c_kv [N, r]`` and post-RoPE ``k_pe [N, rope]``; the pool stores ``c_kv`` (keys) and
  ``k_pe`` (values), exactly what transformers caches. Attention runs in latent space:
  ``q_lat = q_nope · W_uk`` (``kv_b_proj``'s key half), scores ``q_lat·c_kv + q_pe·k_pe``,
  output ``(p · c_kv) · W_uv`` (the value half). Cached latents are never re-expanded. A
  sequence with nothing cached and at least ``EXPAND_MIN_TOKENS`` new tokens expands its
  own chunk instead (cheaper there: head dim 192 instead of 576). Chunks with a cached
  context stay absorbed: re-expanding the cached latents would cost more than it saves for
  every chunk but very long ones. ``bench_splice --switch`` measures both sides of the
  switch (docs/measurements.md).

Decode (one new token per sequence; CPU, fp32 or bf16 pools): every decoding sequence of
the forward in one call per layer of ``kernels/decode_attn.c``, over its runs of pool rows
in place (GQA: kv heads x their query heads; MLA: the latent head x the query heads, key
parts ``c_kv`` and ``k_pe``). Elsewhere (other devices, no C compiler,
``LEYLINE_DECODE_KERNEL=0``) the torch paths below: GQA flash attention per run, MLA
explicit GEMMs.

With no context set both fall through to transformers' own code (sdpa), so the model
object still serves plain forwards (the tests' ground truth) unchanged.
"""

from __future__ import annotations

import os
import sys
import types
from typing import Any

import torch
import torch.nn.functional as F

from leyline_agent.engine.model.context import AttnContext, SeqRows, current
from leyline_agent.kernels import decode_attn

__all__ = [
    "ATTN_IMPLEMENTATION",
    "EXPAND_MIN_TOKENS",
    "install",
    "mla_absorbed",
    "mla_expanded",
    "mla_project",
]

ATTN_IMPLEMENTATION = "leyline"
EXPAND_MIN_TOKENS = 16  # measured: bench_splice --switch
_SCORE_BLOCK = 1 << 22  # absorbed path: scores per block of queries (16 MiB in fp32)
# Up to this many scores, one fused SDPA call instead of five GEMM/softmax ops: each op is a
# parallel region, and on a busy machine with torch's default threads a region costs more
# than the arithmetic of a small attention (tiny models, short contexts).
_FUSED_MAX_SCORES = 1 << 15
# ... and only while the rows it concatenates (``[c_kv | k_pe]``, n x (r + rope)) are few:
# that copy of the sequence's latents, made per layer and step, costs more than the five
# ops it saves (mini MLA at 512 rows: 1.2 MB per call).
_FUSED_MAX_ROWS = 1 << 15
# Decode reads a sequence's rows run by run (views). The engine keeps runs few (decode rows
# are reserved in blocks, ``stepper.py``); past this many, one gathered copy is cheaper.
_MAX_RUNS = 16
Runs = tuple[tuple[int, int], ...]  # (first slot, length) runs of consecutive pool rows
# CPU flash attention with each query row's log-sum-exp (torch's own kernel behind SDPA)
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
# ... and CUDA's (FlashAttention-2 behind SDPA; fp16/bf16 only), the same two outputs first.
# LEYLINE_FLASH_EXTEND=0 keeps CUDA chunks on SDPA with a dense mask (A/B, a device without it)
_FLASH_CUDA = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention", None)
USE_FLASH_EXTEND = os.environ.get("LEYLINE_FLASH_EXTEND", "1") != "0"
# Every decoding sequence of a forward (one new token each) in one call per layer of
# kernels/decode_attn.c where it is built and takes the inputs (CPU); the torch paths
# below serve the rest. LEYLINE_DECODE_KERNEL=0 switches it off (benchmarks' A/B; tests
# check the torch paths with it off).
USE_DECODE_KERNEL = os.environ.get("LEYLINE_DECODE_KERNEL", "1") != "0"


def install(model: Any) -> None:
    """Route ``model``'s attention through the engine (idempotent)."""
    if getattr(model, "_leyline_attention", False):
        return
    _register()
    for mod in model.modules():
        if hasattr(mod, "kv_b_proj") and hasattr(mod, "kv_a_proj_with_mqa"):
            mod._leyline_orig_forward = mod.forward
            mod._leyline_rope = _rope_of(mod)
            mod.forward = types.MethodType(_mla_forward, mod)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    model._leyline_attention = True


# ---------------------------------------------------------------------------------- GQA
def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(ATTN_IMPLEMENTATION, _gqa_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_IMPLEMENTATION, sdpa_mask)


def _gqa_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    ctx = current()
    if ctx is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    layer = module.layer_idx
    pk, pv = ctx.pool.keys[layer], ctx.pool.values[layer]  # [KVH, slots, d]
    pk.index_copy_(1, ctx.slot_mapping, key[0].to(pk.dtype))
    pv.index_copy_(1, ctx.slot_mapping, value[0].to(pv.dtype))
    out = query.new_empty(query.shape[2], query.shape[1], value.shape[-1])  # [N, H, d]
    done = _gqa_decode_kernel(ctx, query, pk, pv, scaling, out)
    for s in ctx.seqs:
        if s.q_len == 1 and done:
            continue
        q = query[:, :, s.q_start : s.q_start + s.q_len]
        if s.q_len == 1:  # decode: a kv head's query heads as its query rows (no broadcast)
            out[s.q_start] = _gqa_decode(q[0], _parts(pk, s, 1), _parts(pv, s, 1), scaling)
            continue
        if s.num_cached and _flash(q) is not None:
            out[s.q_start : s.q_start + s.q_len] = _gqa_extend(q, pk, pv, s, scaling)
            continue
        k, v = _rows(pk, s, 1), _rows(pv, s, 1)
        o = F.scaled_dot_product_attention(
            q, k[None], v[None], attn_mask=_mask(s, q.device), scale=scaling,
            enable_gqa=True, is_causal=s.q_len > 1 and s.num_cached == 0,
        )  # fmt: skip
        out[s.q_start : s.q_start + s.q_len] = o[0].transpose(0, 1)
    return out[None], None


def _gqa_decode_kernel(
    ctx: AttnContext,
    query: torch.Tensor,
    pk: torch.Tensor,
    pv: torch.Tensor,
    scaling: float | None,
    out: torch.Tensor,
) -> bool:
    """The decoding sequences (one new token each) in one kernel call: ``out[q_start]`` of
    each; False (nothing written) where the kernel does not apply."""
    dec = [s for s in ctx.seqs if s.q_len == 1]
    if not dec or not _decode_kernel_on(query):
        return False
    h, d, kvh = query.shape[1], query.shape[-1], pk.shape[0]
    rows = torch.tensor([s.q_start for s in dec], device=query.device)
    q = query[0].transpose(0, 1).index_select(0, rows).view(len(dec), kvh, h // kvh, d)
    if not decode_attn.fits([q], [pk], pv):
        return False
    scale = scaling if scaling is not None else d**-0.5
    o = decode_attn.decode_attention([q], [pk], pv, [s.kv_runs for s in dec], scale)
    out.index_copy_(0, rows, o.view(len(dec), h, -1).to(out.dtype))
    return True


def _decode_kernel_on(x: torch.Tensor) -> bool:
    """Whether the decode kernel may take this forward: a CPU kernel, so never on another
    device (asking there would cost a host-to-device copy and a sync per layer)."""
    return USE_DECODE_KERNEL and x.device.type == "cpu"


def _gqa_decode(
    q: torch.Tensor, ks: list[torch.Tensor], vs: list[torch.Tensor], scaling: float | None
) -> torch.Tensor:
    """One query ``[H, 1, d]`` over the sequence's rows, given as views of the pool (``ks[i]``,
    ``vs[i]``: ``[KVH, run, d]``) -> ``[H, d]``, a kv head's query heads as its query rows.
    One run: one SDPA call. Several, on CPU: one flash-attention call per run, which also
    returns each run's log-sum-exp, and the runs' outputs weighted by their share of the
    total (exact: the softmax over all rows, taken run by run; no rows copied). Other
    devices: the scores of every run side by side, one softmax, the values summed run by run
    (slower than the flash calls on CPU)."""
    kvh = ks[0].shape[0]
    qf = q.reshape(1, kvh, q.shape[0] // kvh, q.shape[-1])  # [1, KVH, group, d]
    if len(ks) == 1:
        o = F.scaled_dot_product_attention(qf, ks[0][None], vs[0][None], scale=scaling)
        return o.reshape(q.shape[0], -1)
    if _FLASH_CPU is not None and q.device.type == "cpu":
        parts = [
            _FLASH_CPU(qf, k[None], v[None], scale=scaling) for k, v in zip(ks, vs, strict=True)
        ]
        return _merge_by_lse(parts).to(q.dtype).reshape(q.shape[0], -1)
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    scores = torch.cat([torch.bmm(qf[0], k.transpose(1, 2)) for k in ks], dim=-1)
    p = torch.softmax(scores.float().mul_(scale), dim=-1).to(vs[0].dtype)
    return _sum_by_runs(p, vs).reshape(q.shape[0], -1)


def flash_path(q: torch.Tensor) -> str:
    """Which flash path a chunk after cached rows takes for ``q``: ``"cuda"`` (CUDA's flash op,
    half precision), ``"cpu"`` (the CPU op, any dtype) or ``"dense"`` (SDPA with a mask)."""
    op = _flash(q)
    return "cuda" if op is _flash_cuda else "cpu" if op is _FLASH_CPU else "dense"


def extend_attention(
    q: torch.Tensor, pk: torch.Tensor, pv: torch.Tensor, s: SeqRows, scaling: float | None
) -> torch.Tensor:
    """The attention of a chunk of new tokens after cached rows, as the engine runs it (for
    checks against an independent computation): ``q [1, H, t, d]`` -> ``[t, H, dv]``."""
    return _gqa_extend(q, pk, pv, s, scaling)


def _flash(q: torch.Tensor) -> Any:
    """The flash-attention op that returns each query row's log-sum-exp for ``q``'s device
    and dtype: ``f(q, k, v, is_causal=, scale=) -> (out, lse)``; None where there is none
    (CUDA in fp32: the dense-mask SDPA path serves it)."""
    if q.device.type == "cpu":
        return _FLASH_CPU
    if (
        q.device.type == "cuda"
        and USE_FLASH_EXTEND
        and _FLASH_CUDA is not None
        and q.dtype in _HALF
    ):
        return _flash_cuda
    return None


_HALF = (torch.float16, torch.bfloat16)


def _flash_cuda(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """CUDA flash attention -> (out ``[B, H, L, d]``, lse ``[B, H, L]``); k/v heads repeated
    up to q's (a chunk's own rows: few) where they differ."""
    if k.shape[1] != q.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    out = _FLASH_CUDA(q, k, v, 0.0, is_causal, False, scale=scale)
    return out[0], out[1]


def _gqa_extend(
    q: torch.Tensor, pk: torch.Tensor, pv: torch.Tensor, s: SeqRows, scaling: float | None
) -> torch.Tensor:
    """A chunk of ``t`` new tokens after cached rows: ``q [1, H, t, d]`` -> ``[t, H, dv]``.
    Every query sees every cached row, so those are attended with no mask, run by run (views
    of the pool), a kv head's query heads folded into its query rows (nothing broadcast);
    the chunk's own rows causally (a square: the flash kernel skips the blocks above the
    diagonal). The parts are merged by their log-sum-exps: the softmax over all rows, exact.
    Cheaper than one SDPA call with a ``[t, n]`` mask, which the CPU flash kernel applies
    block by block (docs/measurements.md); on CUDA (fp16/bf16) it is what lets a long chunk
    run on flash attention with no ``[t, n]`` mask at all (``_flash``)."""
    flash = _flash(q)
    h, t, d = q.shape[1:]
    kvh, c = pk.shape[0], s.num_cached
    cached, own = _split_runs(s.kv_runs, c)
    qf = q.reshape(1, kvh, (h // kvh) * t, d)
    ks, vs = (_views(x, cached, s.kv_slots[:c], 1) for x in (pk, pv))
    parts = []
    for k, v in zip(ks, vs, strict=True):
        o, lse = flash(qf, k[None], v[None], scale=scaling)
        parts.append((o.reshape(1, h, t, -1), lse.reshape(1, h, t)))
    k, v = (_one(x, own, s.kv_slots[c:], 1) for x in (pk, pv))
    parts.append(flash(q, k[None], v[None], is_causal=True, scale=scaling))
    return _merge_by_lse(parts)[0].transpose(0, 1).to(q.dtype)  # [t, H, dv]


def _merge_by_lse(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Attention outputs over disjoint sets of rows (``o [..., d]``, log-sum-exp ``[...]``)
    as the attention over all of them, in fp32: each weighted by its share of the total."""
    share = torch.softmax(torch.stack([lse for _, lse in parts]), dim=0)
    return (torch.stack([o for o, _ in parts]).float() * share[..., None]).sum(0)


def _split_runs(runs: Runs, n: int) -> tuple[Runs, Runs]:
    """``runs`` cut after their first ``n`` rows: (the runs of those rows, the rest's)."""
    head: list[tuple[int, int]] = []
    tail: list[tuple[int, int]] = []
    left = n
    for first, length in runs:
        if left >= length:
            head.append((first, length))
        elif left > 0:
            head.append((first, left))
            tail.append((first + left, length - left))
        else:
            tail.append((first, length))
        left -= min(left, length)
    return tuple(head), tuple(tail)


def _sum_by_runs(p: torch.Tensor, vs: list[torch.Tensor]) -> torch.Tensor:
    """``p [B, t, n]`` (n = the runs' rows end to end) times the runs' values ``[B, run, d]``."""
    o, at = None, 0
    for v in vs:
        part = torch.bmm(p[..., at : at + v.shape[-2]], v)
        o = part if o is None else o.add_(part)
        at += v.shape[-2]
    assert o is not None
    return o


# ---------------------------------------------------------------------------------- MLA
def _rope_of(mod: Any) -> Any:
    """The family's own rotary function (from its transformers module), as (q, k, emb)."""
    tm = sys.modules[type(mod).__module__]
    if hasattr(tm, "apply_rotary_emb"):  # DeepSeek V2: complex freqs_cis
        return tm.apply_rotary_emb
    fn = (
        tm.apply_rotary_pos_emb_interleave
        if getattr(mod.config, "rope_interleave", False)
        else tm.apply_rotary_pos_emb
    )
    return lambda q, k, emb: fn(q, k, *emb)


def _mla_forward(self: Any, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    ctx = current()
    if ctx is None:
        return self._leyline_orig_forward(hidden_states, *args, **kwargs)
    q_nope, q_pe, c_kv, k_pe = mla_project(self, hidden_states, kwargs["position_embeddings"])
    layer = self.layer_idx
    pc, pp = ctx.pool.keys[layer, 0], ctx.pool.values[layer, 0]  # [slots, r], [slots, rope]
    pc.index_copy_(0, ctx.slot_mapping, c_kv.to(pc.dtype))
    pp.index_copy_(0, ctx.slot_mapping, k_pe.to(pp.dtype))
    h, n, v_dim = self.num_heads, hidden_states.shape[1], self.v_head_dim
    # nothing cached and a long chunk: the sequence expands its own latents; the rest run
    # in latent space, W_uk and W_uv applied once for all of them
    expanded: list[SeqRows] = []
    latent: list[SeqRows] = []
    for s in ctx.seqs:
        (expanded if s.num_cached == 0 and s.q_len >= EXPAND_MIN_TOKENS else latent).append(s)
    out = hidden_states.new_empty(h, n, v_dim) if expanded else None
    for s in expanded:
        rows = slice(s.q_start, s.q_start + s.q_len)
        out[:, rows] = mla_expanded(self, q_nope[:, rows], q_pe[:, rows], c_kv[rows], k_pe[rows])
    if latent:
        idx = _row_index(latent, q_nope.device) if expanded else None
        w_uk, w_uv = _mla_weights(self)
        q_lat = torch.bmm(q_nope if idx is None else q_nope.index_select(1, idx), w_uk)
        qp = q_pe if idx is None else q_pe.index_select(1, idx)  # [H, *, r], [H, *, rope]
        o_lat = torch.empty_like(q_lat)
        done = _mla_decode_kernel(self, latent, q_lat, qp, pc, pp, o_lat)
        at = 0
        for s in latent:
            rows = slice(at, at + s.q_len)
            if not (done and s.q_len == 1):
                o_lat[:, rows] = _mla_latent(
                    self, q_lat[:, rows], qp[:, rows], _parts(pc, s, 0), _parts(pp, s, 0)
                )
            at += s.q_len
        o = torch.bmm(o_lat, w_uv.transpose(1, 2))  # [H, *, v]
        if out is None:
            out = o
        else:
            out.index_copy_(1, idx, o)
    return self.o_proj(out.transpose(0, 1).reshape(1, n, h * v_dim)), None


def _mla_decode_kernel(
    self: Any,
    latent: list[SeqRows],
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    pc: torch.Tensor,
    pp: torch.Tensor,
    o_lat: torch.Tensor,
) -> bool:
    """The decoding sequences among ``latent`` (their rows of ``q_lat [H, *, r]`` / ``q_pe``
    in ``latent``'s order) in one kernel call into ``o_lat``; False (nothing written) where
    the kernel does not apply."""
    if not _decode_kernel_on(q_lat):
        return False
    at, rows, dec = 0, [], []
    for s in latent:
        if s.q_len == 1:
            rows.append(at)
            dec.append(s)
        at += s.q_len
    if not dec:
        return False
    idx = torch.tensor(rows, device=q_lat.device)
    qs = [x.index_select(1, idx).transpose(0, 1)[:, None] for x in (q_lat, q_pe)]  # [S,1,H,*]
    k_pools = [pc[None], pp[None]]  # [1, slots, r], [1, slots, rope]
    if not decode_attn.fits(qs, k_pools, k_pools[0]):
        return False
    o = decode_attn.decode_attention(
        qs, k_pools, k_pools[0], [s.kv_runs for s in dec], self.scaling
    )
    o_lat.index_copy_(1, idx, o[:, 0].transpose(0, 1).to(o_lat.dtype))
    return True


def _row_index(seqs: list[SeqRows], device: torch.device) -> torch.Tensor:
    return torch.cat([torch.arange(s.q_start, s.q_start + s.q_len, device=device) for s in seqs])


def _mla_weights(self: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``kv_b_proj``'s key half ``W_uk [H, nope, r]`` and value half ``W_uv [H, v, r]``."""
    r = self.kv_lora_rank
    w = self.kv_b_proj.weight.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, r)
    return w[:, : self.qk_nope_head_dim], w[:, self.qk_nope_head_dim :]


def mla_project(
    self: Any, hidden: torch.Tensor, pos_emb: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The module's own projections: ``q_nope [H,N,nope]``, ``q_pe [H,N,rope]`` (rotated),
    ``c_kv [N, r]`` (normalised), ``k_pe [N, rope]`` (rotated)."""
    n = hidden.shape[1]
    if self.q_lora_rank is None:
        q = self.q_proj(hidden)
    else:
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
    q = q.view(1, n, -1, self.qk_head_dim).transpose(1, 2)
    q_nope, q_pe = torch.split(q, [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
    kv = self.kv_a_proj_with_mqa(hidden)
    c, k_pe = torch.split(kv, [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
    c = self.kv_a_layernorm(c)
    k_pe = k_pe.view(1, 1, n, self.qk_rope_head_dim)
    rope = getattr(self, "_leyline_rope", None) or _rope_of(self)
    q_pe, k_pe = rope(q_pe, k_pe, pos_emb)
    return q_nope[0], q_pe[0], c[0], k_pe[0, 0]


def mla_absorbed(
    self: Any, q_nope: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor
) -> torch.Tensor:
    """Latent-space MLA of t queries over n rows (the last t are the queries' own):
    ``q_nope [H,t,nope]``, ``q_pe [H,t,rope]``, ``c_kv [n,r]``, ``k_pe [n,rope]`` -> ``[H,t,v]``:
    ``q_nope`` absorbed through ``W_uk``, attention over the latents, output through ``W_uv``.
    (The engine's forward absorbs and un-absorbs every sequence of a batch in one GEMM each,
    so the weights are read once per layer, not once per sequence.)"""
    w_uk, w_uv = _mla_weights(self)
    o_lat = _mla_latent(self, torch.bmm(q_nope, w_uk), q_pe, [c_kv], [k_pe])
    return torch.bmm(o_lat, w_uv.transpose(1, 2))  # [H, t, v]


def _mla_latent(
    self: Any,
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    cs: list[torch.Tensor],
    ps: list[torch.Tensor],
) -> torch.Tensor:
    """Attention in latent space: ``q_lat [H,t,r]``, ``q_pe [H,t,rope]`` over the sequence's n
    rows, given as runs (views of the pool, in position order: ``cs[i] [run, r]`` latents,
    ``ps[i] [run, rope]`` post-RoPE keys) -> ``o_lat [H,t,r]``.

    Explicit GEMMs over blocks of queries (at most ``_SCORE_BLOCK`` scores at a time), run by
    run: the scores of every run side by side, one softmax, the output summed run by run (no
    rows copied). On CPU they beat SDPA's GQA path at every chunk size the engine runs
    (``bench_splice --switch``; SDPA would broadcast the one latent head to H heads). Small
    problems (at most ``_FUSED_MAX_SCORES`` scores over at most ``_FUSED_MAX_ROWS`` latent
    values) take one SDPA call with the heads folded into the query rows (one latent head:
    nothing broadcast)."""
    h, t, r = q_lat.shape
    n = sum(c.shape[0] for c in cs)
    if h * t * n <= _FUSED_MAX_SCORES and n * (r + q_pe.shape[-1]) <= _FUSED_MAX_ROWS:
        c_kv = cs[0] if len(cs) == 1 else torch.cat(cs)  # few rows: the copy is small
        k_pe = ps[0] if len(ps) == 1 else torch.cat(ps)
        q = torch.cat([q_lat, q_pe], dim=-1).reshape(1, 1, h * t, -1)
        k = torch.cat([c_kv, k_pe], dim=-1)[None, None]
        mask = _allowed(t, n, q.device).repeat(h, 1) if t > 1 else None
        o = F.scaled_dot_product_attention(
            q, k, c_kv[None, None], attn_mask=mask, scale=self.scaling
        )
        return o.view(h, t, r)
    o_lat = q_lat.new_empty(h, t, r)
    step = max(1, _SCORE_BLOCK // (h * n))
    for i in range(0, t, step):
        j = min(t, i + step)
        b = j - i
        ql, qp = q_lat[:, i:j].reshape(h * b, r), q_pe[:, i:j].reshape(h * b, -1)
        parts = [(ql @ c.T).addmm_(qp, k.T) for c, k in zip(cs, ps, strict=True)]
        scores = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
        scores = scores.view(h, b, n).float().mul_(self.scaling)
        if t > 1:  # query i sits at position n - t + i: it sees rows 0..n - t + i
            scores.masked_fill_(~_allowed_rows(n - t + i, b, n, scores.device), float("-inf"))
        p = torch.softmax(scores, dim=-1).to(cs[0].dtype).view(1, h * b, n)
        o_lat[:, i:j] = _sum_by_runs(p, [c[None] for c in cs]).view(h, b, r)
    return o_lat


def mla_expanded(
    self: Any, q_nope: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor
) -> torch.Tensor:
    """A chunk with nothing cached: expand its own latents (``kv_b_proj``), causal SDPA."""
    h, t, _ = q_nope.shape
    kv = self.kv_b_proj(c_kv).view(t, h, -1).transpose(0, 1)  # [H, t, nope+v]
    k_nope, v = torch.split(kv, [self.qk_nope_head_dim, self.v_head_dim], dim=-1)
    k = torch.cat([k_nope, k_pe[None].expand(h, -1, -1)], dim=-1)
    q = torch.cat([q_nope, q_pe], dim=-1)
    return F.scaled_dot_product_attention(
        q[None], k[None], v[None], is_causal=True, scale=self.scaling
    )[0]


# ---------------------------------------------------------------------------------- rows
def _rows(t: torch.Tensor, s: SeqRows, dim: int) -> torch.Tensor:
    """The sequence's rows of a pool tensor along ``dim`` as one tensor (a view for one run,
    else a gathered copy: extends and prefills, whose compute dwarfs the copy)."""
    return _one(t, s.kv_runs, s.kv_slots, dim)


def _parts(t: torch.Tensor, s: SeqRows, dim: int) -> list[torch.Tensor]:
    """The sequence's rows as views of the pool, one per run (gathered into one copy only
    past ``_MAX_RUNS`` runs, where a Python loop per run would cost more than the copy)."""
    return _views(t, s.kv_runs, s.kv_slots, dim)


def _one(t: torch.Tensor, runs: Runs, slots: torch.Tensor, dim: int) -> torch.Tensor:
    """Rows ``slots`` (= ``runs``) of ``t`` along ``dim``: a view for one run, else a copy."""
    if len(runs) == 1:
        return t.narrow(dim, runs[0][0], runs[0][1])
    return t.index_select(dim, slots)


def _views(t: torch.Tensor, runs: Runs, slots: torch.Tensor, dim: int) -> list[torch.Tensor]:
    """Rows ``slots`` (= ``runs``) of ``t`` along ``dim``: one view per run, or one gathered
    copy past ``_MAX_RUNS`` runs."""
    if len(runs) > _MAX_RUNS:
        return [t.index_select(dim, slots)]
    return [t.narrow(dim, first, n) for first, n in runs]


def _allowed(t: int, n: int, device: torch.device) -> torch.Tensor:
    """``[t, n]``: query i (position n - t + i) sees rows 0..n - t + i."""
    return _allowed_rows(n - t, t, n, device)


def _allowed_rows(first: int, t: int, n: int, device: torch.device) -> torch.Tensor:
    """``[t, n]``: query i (position first + i) sees rows 0..first + i."""
    cols = torch.arange(n, device=device)
    rows = torch.arange(first, first + t, device=device)
    return cols[None, :] <= rows[:, None]


def _mask(s: SeqRows, device: torch.device) -> torch.Tensor | None:
    if s.q_len == 1 or s.num_cached == 0:
        return None
    return _allowed(s.q_len, s.kv_len, device)
