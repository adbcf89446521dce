"""Benchmark (not a test): AMORTIZE a tail vs re-prefilling it, mini MLA model, one run.

    .venv/bin/python -m leyline_agent.experiments.bench_splice [--model DIR] [--tails 512,2048,8192]

For each tail length N, the cached sequence is ``T = prefix(256) + span(16) + tail(N)``.
The directive replaces the span by 8 new tokens (delta = -8):

- AMORTIZE: prefill the 8 tokens over the prefix, copy the tail's latents to fresh slots
  and rotate its ``k_pe`` by delta (``rotate_band``): the engine's real path.
- re-prefill: the same directive in FORGET mode: prefill the 8 tokens + the N tail tokens
  over the prefix (what a prefix cache without splices costs the next request).

Both go through ``Engine.apply_directives`` on the same engine; the table prints the
median of ``--reps`` AMORTIZE runs, one re-prefill per size (or ``--reps`` with
``--full-reps``), and their ratio. Without ``--model``, the mini DeepSeek-V2 checkpoint is
built once (seeded) into the test-model cache.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time


def _median_time(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _tail_move(eng, tokens: list[int], start: int) -> None:
    """The tail-dependent part alone: copy the tail to fresh slots, rotating k_pe (then free)."""
    src = eng.cache.tree.match_prefix(tokens).slots[start:]
    dst = eng.allocator.alloc(len(src))
    eng.pool.copy_rotated(src, dst, -8)
    eng.allocator.free(dst)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", help="model dir (default: build the mini deepseek_v2)")
    ap.add_argument("--tails", default="512,2048,8192")
    ap.add_argument("--prefix", type=int, default=256)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--full-reps", action="store_true", help="repeat the re-prefill too")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (0: torch default; 1 is steadiest on a shared machine)",
    )
    args = ap.parse_args(argv)

    import torch

    from leyline_agent.engine.engine import Engine, SamplingParams
    from leyline_agent.wire import DirectivesRequest

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.model:
        path = args.model
    else:
        from leyline_agent.engine.checkpoints.store import model_dir

        path = model_dir("deepseek_v2", "mini", 0)
    tails = [int(x) for x in args.tails.split(",")]
    eng = Engine.from_pretrained(
        path, dtype=args.dtype, device="cpu", cache_budget_tokens=4 * (max(tails) + 1024)
    )
    cfg = eng.config
    print(
        f"model {path}: {cfg.model_type}, layers={cfg.num_hidden_layers}, hidden={cfg.hidden_size}, "
        f"kv_lora_rank={cfg.kv_lora_rank}, rope_dim={cfg.qk_rope_head_dim}, dtype={args.dtype}, "
        f"threads={torch.get_num_threads()}"
    )
    rng = random.Random(0)
    rows = []
    for n in tails:
        T = [rng.randrange(3, eng.vocab_size - 2) for _ in range(args.prefix + 16 + n)]
        s, e = args.prefix, args.prefix + 16
        R = [rng.randrange(3, eng.vocab_size - 2) for _ in range(8)]
        t = time.perf_counter()
        eng.generate(T, SamplingParams(max_tokens=0))
        cache_s = time.perf_counter() - t

        def run(mode: str, T=T, s=s, e=e, R=R) -> None:
            d = {"start": s, "end": e, "replacement": R, "mode": mode}
            eng.apply_directives(DirectivesRequest(tokens=T, directives=[d]))

        run("amortize")  # warm-up
        amortize = _median_time(lambda: run("amortize"), args.reps)
        forget = _median_time(lambda: run("forget"), args.reps if args.full_reps else 1)
        move = _median_time(lambda T=T, e=e: _tail_move(eng, T, e), args.reps)
        rows.append((n, amortize, forget, move))
        print(
            f"  tail {n}: cache T {cache_s:.1f} s, amortize {amortize * 1e3:.1f} ms "
            f"(tail move {move * 1e3:.1f} ms), re-prefill {forget * 1e3:.1f} ms",
            flush=True,
        )
    print()
    print(
        f"{'tail':>6} | {'AMORTIZE ms':>11} | {'tail move ms':>12} | {'re-prefill ms':>13} | {'ratio':>7}"
    )
    print(f"{'-' * 6}-+-{'-' * 11}-+-{'-' * 12}-+-{'-' * 13}-+-{'-' * 7}")
    for n, a, f, mv in rows:
        print(f"{n:>6} | {a * 1e3:>11.1f} | {mv * 1e3:>12.2f} | {f * 1e3:>13.1f} | {f / a:>6.1f}x")
    st = eng.stats()
    print(f"\nsplices {st.splices}, rotated tokens {st.rotated_tokens}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
