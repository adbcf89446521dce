"""Effective bandwidth of rotate_band against a plain copy of the same bytes, in one run.

    .venv/bin/python experiments/bench/bench_kernel.py [--rows 4096,32768,262144] [--layers 27]
        [--device cpu|cuda] [--dtype bfloat16|float16|float32] [--repeats N]
        [--layer-buffers N]

Buffer: one DeepSeek-V2-Lite MLA pool per layer as SGLang lays it out, ``[2 * rows, 1, 576]``
(latent 512 | k_pe 64, band at offset 512, interleaved pairs, YaRN frequencies). Two cases:

* ``splice``: rows ``[0, rows)`` move to ``[rows, 2 * rows)`` with Δ = -37 (copy-on-write of
  whole rows: every byte of a row read once and written once). Baseline: ``copy_`` of the
  same rows (a contiguous memcpy of the same byte count).
* ``in-place``: rows rotated where they are; only the 64-wide band is read and written.
  Baseline: ``copy_`` of the same band bytes between the two halves (same strided pattern).

Effective bandwidth = (bytes read + bytes written) / time; the ratio rotate/copy is the
figure (>= 80% is the goal on a GPU; the physical limit is memory bandwidth). The index plan
is validated once (``plan_rotation``) and applied per layer (``apply_plan``), as a splice
does on every layer; the last column adds the per-call validation of ``rotate_band``.

On CPU the C kernel runs (``rotate_band_c.py``; ``LEYLINE_KERNEL=torch`` for the torch
reference, which fp16 buffers take anyway; the Triton kernel runs only interpreted there:
far too slow to time). To fit memory and ~2 minutes, CPU defaults to ``--layer-buffers 1`` (the same pool
is rotated once per layer; at 256k rows a pool is 604 MB, far larger than any cache, so
reuse does not flatter the numbers), ``--timed-layers 2`` (each layer is the same
independent call, so per-layer figures do not depend on how many are timed), one timed pass
and no validation column. On CUDA every layer gets its own pool (27 x 604 MB at 256k rows),
all layers are timed, 10 passes, median. CPU runs one torch thread by default: on a small
shared machine OpenMP threads that spin while another process holds the core make every op
10-20x slower, copy and rotation alike (``--threads`` to change).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from leyline_agent.kernels import RopeSpec, apply_plan, plan_rotation, rotate_band

LATENT, ROPE = 512, 64
WIDTH = LATENT + ROPE


def _spec() -> RopeSpec:
    from leyline_agent.reference.rope_configs import deepseek_v2_lite_yarn

    config = deepseek_v2_lite_yarn()
    assert (config.kv_lora_rank, config.qk_rope_head_dim) == (LATENT, ROPE)
    return RopeSpec.from_hf_config(config, cache_owner="sglang")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _per_layer_seconds(fn, pools, layers: int, repeats: int, device: torch.device) -> float:
    """Median over ``repeats`` of (time for one pass over all layers) / layers."""
    for pool in pools[:2]:  # warm-up (Triton compiles on first use)
        fn(pool)
    _sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for i in range(layers):
            fn(pools[i % len(pools)])
        _sync(device)
        times.append((time.perf_counter() - start) / layers)
    return statistics.median(times)


def bench(
    rows: int, layers: int, n_buffers: int, dtype, device, repeats: int, validate: bool
) -> list[dict]:
    spec = _spec()
    pools = [torch.randn(2 * rows, 1, WIDTH, device=device).to(dtype) for _ in range(n_buffers)]

    def view(p: torch.Tensor) -> torch.Tensor:  # [slots, 1, 576] -> [1, slots, 576]
        return p.transpose(0, 1)

    src = torch.arange(rows, device=device)
    esize = pools[0].element_size()
    out = []
    for case, dst, row_bytes in [
        ("splice", src + rows, WIDTH * esize),
        ("in-place", src, ROPE * esize),
    ]:
        plan = plan_rotation(view(pools[0]), src, dst, -37, spec, LATENT)

        def rotate(p, plan=plan):
            apply_plan(view(p), plan, spec)

        def rotate_validated(p, dst=dst):
            rotate_band(view(p), src, dst, -37, spec, LATENT)

        if case == "splice":

            def copy(p):
                p[rows:].copy_(p[:rows])
        else:

            def copy(p):
                p[rows:, :, LATENT:].copy_(p[:rows, :, LATENT:])

        t_rot = _per_layer_seconds(rotate, pools, layers, repeats, device)
        t_copy = _per_layer_seconds(copy, pools, layers, repeats, device)
        t_val = (
            _per_layer_seconds(rotate_validated, pools, layers, repeats, device)
            if validate
            else float("nan")
        )
        moved = 2 * rows * row_bytes  # read + write
        out.append(
            dict(
                case=case,
                rows=rows,
                mb=moved / 1e6,
                rot_ms=t_rot * 1e3,
                rot_gbs=moved / t_rot / 1e9,
                copy_gbs=moved / t_copy / 1e9,
                ratio=t_copy / t_rot,
                val_ms=t_val * 1e3,
                backend=plan.backend,
            )
        )
    del pools
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rows", default="4096,32768,262144")
    ap.add_argument("--layers", type=int, default=27)
    ap.add_argument("--device", choices=["cpu", "cuda"], default=None)
    ap.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    ap.add_argument("--repeats", type=int, default=None, help="timed passes (cpu 1, cuda 10)")
    ap.add_argument("--layer-buffers", type=int, default=None, help="cpu 1, cuda = --layers")
    ap.add_argument(
        "--timed-layers", type=int, default=None, help="layers per timed pass (cpu 2, cuda all)"
    )
    ap.add_argument(
        "--validate",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also time rotate_band with per-call validation (default: on for cuda)",
    )
    ap.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (cpu default 1, see doc)"
    )
    args = ap.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    repeats = args.repeats or (10 if device.type == "cuda" else 1)
    n_buffers = args.layer_buffers or (args.layers if device.type == "cuda" else 1)
    timed = args.timed_layers or (args.layers if device.type == "cuda" else min(2, args.layers))
    validate = device.type == "cuda" if args.validate is None else args.validate
    dtype = getattr(torch, args.dtype)
    if device.type == "cpu":
        torch.set_num_threads(args.threads or 1)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(
        f"device={name} dtype={args.dtype} layers={args.layers} layer_buffers={n_buffers} "
        f"threads={torch.get_num_threads()} timed_layers={timed} repeats={repeats} width={WIDTH} band={ROPE}@{LATENT}"
    )
    header = (
        f"{'case':<9} {'rows':>7} {'backend':>7} {'MB/layer':>9} {'rot ms/layer':>12} "
        f"{'rot GB/s':>9} {'copy GB/s':>9} {'rot/copy':>8} {'+validate ms':>12}"
    )
    print(header)
    print("-" * len(header))
    for rows in (int(r) for r in args.rows.split(",")):
        for r in bench(rows, timed, n_buffers, dtype, device, repeats, validate):
            print(
                f"{r['case']:<9} {r['rows']:>7} {r['backend']:>7} {r['mb']:>9.1f} "
                f"{r['rot_ms']:>12.3f} {r['rot_gbs']:>9.1f} {r['copy_gbs']:>9.1f} "
                f"{r['ratio']:>7.0%} {r['val_ms']:>12.3f}"
            )


if __name__ == "__main__":
    main()
