"""Benchmark (not a test): an edit in the middle of the context, AMORTIZE vs REPAIR vs FORGET
vs a forward.

    .venv/bin/python -m leyline_agent.experiments.bench.bench_splice [--archs deepseek_v2,llama]
        [--halves 2048,4096,8192] [--span 256] [--replacement 16] [--reps 3] [--forget-reps 1]
        [--repair-budget 0.02]
        [--switch] [--drift] [--shapes llama-1b,dsv2-lite --device cuda --dtype bfloat16]

For each ``mini`` model (built once, seeded) and each half length H, the cached sequence is
``T = prefix(H) + span(256) + tail(H)`` (H = 2048 / 4096 / 8192: the "4k", "8k" and "16k"
cases), and the directive replaces the span by 16 new tokens (delta = -240):

- AMORTIZE: ``Engine.apply_directives``: R (16 tokens) prefilled over the prefix, the tail's
  rows copied to fresh slots with their rotary band turned by delta, ``T'`` cached;
- REPAIR: the same directive in REPAIR mode at ``--repair-budget``: AMORTIZE, then that
  fraction of the tail's rows recomputed in place (the engine's default selector; random
  tokens share no bigram with the span, so these are the first tail rows after R);
- FORGET: the same directive in FORGET mode: R + the tail prefilled over the prefix;
- forward64: a plain forward of 64 new tokens after the whole cached ``T``
  (``Engine.logits_for``), the cost of an ordinary next turn.

They run interleaved in one loop (best of ``--reps``; FORGET best of ``--forget-reps``)
on the same engine; the table gives their ratios. AMORTIZE is split into its parts, timed
alone in the same loop: R's forward over the prefix, the tail move (``KVPool.copy_rotated``),
and the rest (lookups, plan, tree insert, pin). ``--switch`` measures the MLA
expand-vs-absorb switch (``attention.py``); ``--drift`` the bf16 drift of a directive batch.
``--shapes`` (``shapes.py``: the ``mini`` checkpoints, ``llama-1b``, ``dsv2-lite``) replaces
``--archs`` for the table; ``--device cuda`` runs it on a GPU (every timed call ends with a
device synchronize).
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable
from typing import Any

import torch

from leyline_agent.directives.repair import DEFAULT_BUDGET, rows_for

from ..options import standalone


def _csv(text: str) -> list[str]:
    return [p for p in text.split(",") if p]


def _sync() -> None:
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _best(fn: Callable[[], Any], k: int) -> float:
    times = []
    for _ in range(k):
        _sync()
        t = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - t)
    return min(times)


def _engine(arch: str, dtype: str, budget: int, device: str = "cpu", small: bool = False) -> Any:
    from .shapes import engine_for

    shape = arch if "-" in arch else f"mini-{arch}"
    return engine_for(shape, device, dtype, budget, small=small)


# ---------------------------------------------------------------------------- the table
def measure(arch: str, half: int, a: argparse.Namespace) -> dict[str, float]:
    from leyline_agent.engine.engine import SamplingParams
    from leyline_agent.namespaces import ANONYMOUS
    from leyline_agent.wire import DirectivesRequest

    n = 2 * half + a.span
    eng = _engine(arch, a.dtype, 4 * (n + 1024), a.device, a.small)
    rng = random.Random(half)
    T = [rng.randrange(3, eng.vocab_size - 2) for _ in range(n)]
    R = [rng.randrange(3, eng.vocab_size - 2) for _ in range(a.replacement)]
    X = [rng.randrange(3, eng.vocab_size - 2) for _ in range(64)]
    s, e = half, half + a.span
    cache_s = _best(lambda: eng.generate(T, SamplingParams(max_tokens=0)), 1)

    def directive(mode: str) -> None:
        d: dict[str, Any] = {"start": s, "end": e, "replacement": R, "mode": mode}
        if mode == "repair":
            d["budget"] = a.repair_budget
        eng.apply_directives(DirectivesRequest(tokens=T, directives=[d]))

    def r_forward() -> None:
        with eng.stepper.exclusive():
            m = eng.cache.match(T, ANONYMOUS)
            eng.allocator.free(eng.runner.prefill_into_slots(m.slots[:s], R))

    def tail_move() -> None:
        with eng.stepper.exclusive():
            src = eng.cache.match(T, ANONYMOUS).slots[e:]
            dst = eng.allocator.alloc(len(src))
            eng.pool.copy_rotated(src, dst, len(R) - a.span)
            eng.allocator.free(dst)

    directive("amortize")  # warm-up (allocations, first-call paths)
    eng.logits_for(T + X)
    best: dict[str, float] = {}
    for rep in range(a.reps):
        parts = [("amortize", lambda: directive("amortize")), ("forward64", lambda: eng.logits_for(T + X)),
                 ("r_forward", r_forward), ("tail_move", tail_move),
                 ("repair", lambda: directive("repair"))]  # fmt: skip
        if rep < a.forget_reps:
            parts.append(("forget", lambda: directive("forget")))
        for name, fn in parts:
            best[name] = min(best.get(name, float("inf")), _best(fn, 1))
    best["cache_s"] = cache_s
    best["other"] = max(0.0, best["amortize"] - best["r_forward"] - best["tail_move"])
    return best


def table(a: argparse.Namespace) -> None:
    print(
        "| model | T tokens (prefix+span+tail) | AMORTIZE ms | R forward ms | tail move ms "
        "| other ms | REPAIR ms (rows) | FORGET ms | forward64 ms | FORGET/AMORTIZE "
        "| REPAIR/FORGET | AMORTIZE/forward64 |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for arch in _csv(a.shapes or a.archs):
        name = arch if "-" in arch else f"{arch} mini"
        for half in map(int, _csv(a.halves)):
            m = measure(arch, half, a)
            ms = {k: 1e3 * v for k, v in m.items()}
            print(
                f"| {name} | {2 * half + a.span} ({half}+{a.span}+{half}) "
                f"| {ms['amortize']:.1f} | {ms['r_forward']:.1f} | {ms['tail_move']:.1f} "
                f"| {ms['other']:.1f} | {ms['repair']:.1f} ({rows_for(a.repair_budget, half)}) "
                f"| {ms['forget']:.0f} | {ms['forward64']:.1f} "
                f"| {m['forget'] / m['amortize']:.0f}x | {m['repair'] / m['forget']:.3f}x "
                f"| {m['amortize'] / m['forward64']:.2f}x |",
                flush=True,
            )


# ---------------------------------------------------------------------------- the MLA switch
def switch(a: argparse.Namespace) -> int:
    """Absorbed vs expanded MLA attention of one chunk, on layer 0 of the mini DeepSeek-V2
    (its own weights), chunk sizes 16..512, with nothing cached and with ``--switch-cached``
    rows cached. Prints the smallest chunk from which expanding its own chunk is faster with
    nothing cached (the engine's ``EXPAND_MIN_TOKENS``)."""
    from leyline_agent.engine.model import attention as att

    eng = _engine("deepseek_v2", a.dtype, 1024)
    mod = eng.model.model.layers[0].self_attn
    h, dt = mod.num_heads, eng.dtype
    g = torch.Generator().manual_seed(0)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dt)

    sizes = [16, 32, 64, 128, 256, 512]
    cached = a.switch_cached
    print(f"MLA switch, {eng.config.model_type} mini layer 0, {a.dtype}, "
          f"{torch.get_num_threads()} thread(s), best of {a.reps}")  # fmt: skip
    print("| chunk | cached | absorbed ms | expanded ms | expanded/absorbed |")
    print("|---|---|---|---|---|")
    first = None
    with torch.inference_mode():
        for c in (0, cached):
            for t in sizes:
                qn, qp = rnd(h, t, mod.qk_nope_head_dim), rnd(h, t, mod.qk_rope_head_dim)
                ckv, kpe = rnd(c + t, mod.kv_lora_rank), rnd(c + t, mod.qk_rope_head_dim)
                xs = (mod, qn, qp, ckv, kpe)
                ab = _best(lambda xs=xs: att.mla_absorbed(*xs), a.reps)
                ex = _best(lambda xs=xs: _expanded_over(*xs), a.reps)
                if c == 0 and ex < ab and first is None:
                    first = t  # smallest size from which expanding wins at every larger one
                if c == 0 and ex >= ab:
                    first = None
                print(f"| {t} | {c} | {1e3 * ab:.2f} | {1e3 * ex:.2f} | {ex / ab:.2f} |",
                      flush=True)  # fmt: skip
    print(
        f"switch point (nothing cached): expanding is faster from {first} tokens on "
        f"(engine: EXPAND_MIN_TOKENS = {att.EXPAND_MIN_TOKENS}); with {cached} rows cached the "
        "column shows re-expanding the cached latents, which the engine never does"
    )
    return 0


def _expanded_over(mod: Any, q_nope: Any, q_pe: Any, c_kv: Any, k_pe: Any) -> Any:
    """Expanded MLA of t queries over all n rows (the engine's own-chunk path when n == t;
    with rows cached it re-expands them, which the engine does not: for comparison only)."""
    from leyline_agent.engine.model import attention as att

    h, t, _ = q_nope.shape
    n = c_kv.shape[0]
    if n == t:
        return att.mla_expanded(mod, q_nope, q_pe, c_kv, k_pe)
    kv = mod.kv_b_proj(c_kv).view(n, h, -1).transpose(0, 1)
    k_nope, v = torch.split(kv, [mod.qk_nope_head_dim, mod.v_head_dim], dim=-1)
    k = torch.cat([k_nope, k_pe[None].expand(h, -1, -1)], dim=-1)
    q = torch.cat([q_nope, q_pe], dim=-1)
    mask = torch.arange(n)[None, :] <= torch.arange(n - t, n)[:, None]
    return torch.nn.functional.scaled_dot_product_attention(
        q[None], k[None], v[None], attn_mask=mask, scale=mod.scaling
    )[0]


# ---------------------------------------------------------------------------- bf16 drift
def drift(a: argparse.Namespace) -> int:
    """bf16 engine, one batch of ``--drift-directives`` AMORTIZEs (span 16 -> 4 tokens) over
    ``--drift-tokens`` cached tokens, executed per directive (each tail rotated once per
    directive to its left) and with one rotation per row (cumulative delta). Rel-L2 of the
    rotary band of the last tail (rotated by every directive) against (a) the fp32
    from-scratch reference (``RefState``: the model's own forwards and rotary functions;
    includes bf16's forward error, shown alone as 'before' on the unspliced rows) and (b)
    the exact (fp64) rotation of the rows as stored in bf16 (what the rotations add)."""
    from transformers import AutoModelForCausalLM

    from leyline_agent.engine.checkpoints.store import model_dir
    from leyline_agent.engine.engine import SamplingParams
    from leyline_agent.engine.executor import apply_request
    from leyline_agent.kernels.rotate_band import pair_views
    from leyline_agent.namespaces import DEFAULT_TENANT, Namespace
    from leyline_agent.reference.kv_reference import RefState
    from leyline_agent.wire import DirectivesRequest

    k, n = a.drift_directives, a.drift_tokens
    print(f"bf16 drift: {k} AMORTIZEs (span 16 -> 4) in one batch over {n} cached tokens; "
          "rel-L2 of the last tail's rotary band")  # fmt: skip
    print("| model | rows | before splice vs fp32 ref | per-directive vs fp32 ref "
          "| cumulative vs fp32 ref | per-directive vs exact rotation "
          "| cumulative vs exact rotation |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for arch in _csv(a.archs):
        eng = _engine(arch, "bfloat16", 1 << 16)
        ref_model = AutoModelForCausalLM.from_pretrained(
            model_dir(arch, "mini", 0), dtype=torch.float32
        ).eval()
        rng = random.Random(5)
        T = [rng.randrange(3, eng.vocab_size - 2) for _ in range(n)]
        gap = (n - 64 - 16) // (k + 1)
        ds = [
            {"start": 64 + i * gap, "end": 64 + i * gap + 16, "mode": "amortize",
             "replacement": [rng.randrange(3, eng.vocab_size - 2) for _ in range(4)]}
            for i in range(k)
        ]  # fmt: skip
        eng.generate(T, SamplingParams(max_tokens=0))
        e_last, shift = ds[-1]["end"], -12 * k
        lo = e_last + shift  # the last tail in T'
        band = (
            (1, slice(None))
            if eng.layout.kind == "mla"
            else (0, slice(0, eng.rope_spec.rotary_dim))
        )

        def bands(tokens: list[int], ns: Namespace, start: int, eng=eng, band=band) -> Any:
            m = eng.cache.tree.match_prefix(tokens, ns)
            kv = eng.pool.as_cache_data(m.slots)
            return torch.stack([lay[band[0]][0, :, start:, band[1]].double() for lay in kv])

        ref = RefState.prefill(ref_model, T)
        ref_t = torch.stack([lay[band[0]][0, :, e_last:, band[1]].double() for lay in ref.kv()])
        stored = bands(T, Namespace(DEFAULT_TENANT, None), e_last)
        for d in reversed(ds):
            ref = ref.amortize(d["start"], d["end"], d["replacement"])
        ref_s = torch.stack([lay[band[0]][0, :, lo:, band[1]].double() for lay in ref.kv()])
        inv = eng.rope_spec.inv_freq_tensor().double()
        ang = shift * inv
        sa, sb = pair_views(stored, eng.rope_spec.layout)
        exact = stored.clone()
        ea, eb = pair_views(exact, eng.rope_spec.layout)
        ea.copy_(sa * ang.cos() - sb * ang.sin())
        eb.copy_(sb * ang.cos() + sa * ang.sin())
        out = []
        for label, per in (("per-directive", True), ("cumulative", False)):
            ns = Namespace(DEFAULT_TENANT, label)
            req = DirectivesRequest(tokens=T, directives=ds)
            with eng.stepper.exclusive():
                resp = apply_request(eng, req, ns, per_directive=per)
            got = bands(resp.tokens, ns, lo)
            out.append((rel(got, ref_s), rel(got, exact)))
        print(
            f"| {arch} mini | {n - e_last} | {rel(stored, ref_t):.2e} | {out[0][0]:.2e} "
            f"| {out[1][0]:.2e} | {out[0][1]:.2e} | {out[1][1]:.2e} |",
            flush=True,
        )
    return 0


def rel(x: torch.Tensor, y: torch.Tensor) -> float:
    """Relative L2 error of ``x`` against ``y``."""
    return float((x - y).norm() / y.norm())


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--archs", default="deepseek_v2,llama", help="mini models to run")
    ap.add_argument("--halves", default="2048,4096,8192", help="prefix = tail lengths")
    ap.add_argument("--span", type=int, default=256, help="tokens the directive replaces")
    ap.add_argument("--replacement", type=int, default=16, help="tokens of R")
    ap.add_argument("--reps", type=int, default=3, help="best of this many (AMORTIZE, forward)")
    ap.add_argument("--forget-reps", type=int, default=1, help="best of this many FORGETs")
    ap.add_argument(
        "--repair-budget", type=float, default=DEFAULT_BUDGET, help="REPAIR's fraction of the tail"
    )
    ap.add_argument("--dtype", default="float32", help="float32 or bfloat16")
    ap.add_argument("--shapes", default=None, help="model shapes for the table (shapes.py)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (the table only)")
    ap.add_argument("--small", action="store_true", help="shrunk shapes (a dry run)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (0: torch default)")
    ap.add_argument("--switch", action="store_true", help="only the MLA expand/absorb switch")
    ap.add_argument("--switch-cached", type=int, default=4096, help="cached rows for --switch")
    ap.add_argument("--drift", action="store_true", help="only the bf16 drift of a batch")
    ap.add_argument("--drift-directives", type=int, default=16, help="AMORTIZEs of --drift's batch")
    ap.add_argument("--drift-tokens", type=int, default=1024, help="cached tokens for --drift")


def main(a: argparse.Namespace) -> int:
    if a.threads:
        torch.set_num_threads(a.threads)
    dev = torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu"
    print(f"dtype {a.dtype}, {torch.get_num_threads()} thread(s), device {dev}")
    if a.switch:
        return switch(a)
    if a.drift:
        return drift(a)
    table(a)
    return 0


if __name__ == "__main__":
    raise SystemExit(standalone(add_arguments, main))
