"""Benchmark (not a test): the embedded engine vs transformers' own ``generate``, one run.

    leyline bench engine [--archs deepseek_v2,llama] [--contexts 512,2048,8192,16384]
                         [--decode 8] [--dtype float32] [--threads 1] [--runner]
                         [--shapes llama-1b --device cuda --dtype bfloat16]

For each ``mini`` model (built once, seeded, into the test-model cache) and cached context
length n (random token ids):

- engine: ``Engine.generate`` of the context once (prefill; tokens/s), then the same
  context plus one token with ``--decode`` new tokens: it hits the cache, so its time
  after the first token is pure decode (ms/token; at least 16 tokens, whatever
  ``--decode`` says), attention reading the pool by slot.
  Then once more (another last token) with decode attention on the engine's torch paths
  instead of ``kernels/decode_attn.c``: the kernel's share, side by side. In bf16, once more
  with the linear layers on oneDNN's packed product instead of ``kernels/skinny_linear.c``
  (fp32 does not use that kernel: the column says "-").
- transformers: a forward of the context into a fresh ``DynamicCache`` (its prefill,
  tokens/s), then ``model.generate`` (greedy, ``--decode`` new tokens) on that cache: its
  time per generated token is the decode ms/token (no difference of two long runs, which
  the prefill's noise swamped). Same model object, dtype, threads.

``--shapes`` (``shapes.py``: ``llama-1b``, ``dsv2-lite``, the ``mini`` checkpoints) replaces
``--archs``; ``--device cuda`` runs both sides on a GPU (each timed call ends with a device
synchronize, after one untimed warm-up of each side; the CPU kernels' columns say "-").
transformers' prefill computes the last position's logits only (``logits_to_keep=1``), as the
engine does.

Prints one table with the ratios (engine / transformers speed-ups). ``--runner`` instead
prints what bounds batched decode here: one packed decode forward of 1..16 sequences
(``ModelRunner.run``, no scheduler, no threads), with the linear weights oneDNN-packed (the
default) and plain, side by side, and the machine's read bandwidth.
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

from ..options import standalone

__all__ = ["add_arguments", "main"]


def _csv(text: str) -> list[str]:
    return [p for p in text.split(",") if p]


def _ms(v: float) -> str:
    return "-" if v != v else f"{v:.1f}"  # NaN: not measured


def _sync() -> None:
    import torch

    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _hf(model: Any, ids: list[int], new: int) -> tuple[float, float]:
    """transformers' own path: a forward of ``ids[:-1]`` into a fresh ``DynamicCache``
    (prefill seconds), then ``model.generate`` of ``new`` tokens on that cache (it forwards
    the last prompt token, then decodes): seconds per generated token."""
    import torch
    from transformers import DynamicCache

    x = torch.tensor([ids], device=model.device)
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        _sync()
        t = time.perf_counter()
        model(input_ids=x[:, :-1], past_key_values=cache, use_cache=True, logits_to_keep=1)
        _sync()
        prefill = time.perf_counter() - t
        t = time.perf_counter()
        model.generate(
            x, max_new_tokens=new, min_new_tokens=new, do_sample=False,
            past_key_values=cache, pad_token_id=0,
        )  # fmt: skip
        _sync()
        decode = (time.perf_counter() - t) / new
    return prefill, decode


def _decode_s(eng: Any, ids: list[int], p: Any, off: tuple[Any, str] | None = None) -> float:
    """Seconds per token after the first of one ``generate``; ``off`` = (module, switch):
    that kernel switch is False during the run."""
    old = None if off is None else getattr(*off)
    if off is not None:
        setattr(*off, False)
    try:
        r = eng.generate(ids, p)
    finally:
        if off is not None:
            setattr(*off, old)
    return (r.e2e_s - r.ttft_s) / max(1, len(r.output_ids) - 1)


def _shape(arch: str) -> str:
    return arch if "-" in arch else f"mini-{arch}"


def measure(
    arch: str, n: int, decode: int, dtype: str, device: str = "cpu", small: bool = False
) -> dict[str, float]:
    from leyline_agent.engine.engine import SamplingParams
    from leyline_agent.engine.model import attention, linear

    from .shapes import engine_for

    eng = engine_for(_shape(arch), device, dtype, n + 256, small=small)
    rng = random.Random(n)
    ids = [rng.randrange(100, eng.vocab_size) for _ in range(n)]
    gpu = eng.device.type == "cuda"
    if gpu:  # first-call work (cuDNN plans, allocator) off the clock, on both sides
        warm = [rng.randrange(100, eng.vocab_size) for _ in range(min(n, 1024))]
        eng.generate(warm, SamplingParams(max_tokens=2, stop_token_ids=[]))
        _hf(eng.model, warm, 2)
    _sync()
    t = time.perf_counter()
    eng.generate(ids, SamplingParams(max_tokens=1, stop_token_ids=[]))
    _sync()
    e_prefill = time.perf_counter() - t
    # the engine's decode is cheap: at least 16 tokens, so that one slow step moves it less
    p = SamplingParams(max_tokens=max(decode, 16), stop_token_ids=[])
    e_dec = _decode_s(eng, ids + [ids[0]], p)
    # the same engine with decode attention on its torch paths (no kernels/decode_attn.c)
    t_dec = float("nan")
    if not gpu:
        t_dec = _decode_s(eng, ids + [ids[1]], p, off=(attention, "USE_DECODE_KERNEL"))
    l_dec = None
    if not gpu and eng.runner.pool.dtype in linear.KERNEL_DTYPES:  # few-row linears on oneDNN
        l_dec = _decode_s(eng, ids + [ids[2]], p, off=(linear, "USE_LINEAR_KERNEL"))
    eng.model.config._attn_implementation = "sdpa"  # transformers' own path for the baseline
    h_prefill, h_dec = _hf(eng.model, ids, decode)
    return {
        "engine_prefill_tps": n / e_prefill,
        "hf_prefill_tps": (n - 1) / h_prefill,
        "engine_decode_ms": 1e3 * e_dec,
        "torch_attn_decode_ms": 1e3 * t_dec,  # NaN on a GPU: the CPU kernel is not used
        "onednn_linear_decode_ms": float("nan") if l_dec is None else 1e3 * l_dec,
        "hf_decode_ms": 1e3 * h_dec,
    }


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The flags (stdlib only: the CLI builds its parser without importing torch)."""
    ap.add_argument("--archs", default="deepseek_v2,llama", help="mini models to run")
    ap.add_argument("--contexts", default="512,2048,8192,16384", help="cached context lengths")
    ap.add_argument("--decode", type=int, default=8, help="new tokens per decode run (>= 2)")
    ap.add_argument("--dtype", default="float32", help="float32 or bfloat16")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--clients", type=int, default=8, help="concurrency section (0: skip)")
    ap.add_argument("--clients-context", type=int, default=512, help="prompt tokens per client")
    ap.add_argument("--clients-decode", type=int, default=64, help="new tokens per client")
    ap.add_argument("--shapes", default=None, help="model shapes instead of --archs (shapes.py)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--small", action="store_true", help="shrunk shapes (a dry run)")
    ap.add_argument(
        "--runner",
        action="store_true",
        help="only the batch scaling of one packed decode forward (ModelRunner.run, 512-token "
        "contexts, batch 1..16) and this machine's read bandwidth",
    )


def main(a: argparse.Namespace) -> int:
    import torch

    if a.decode < 2:
        raise SystemExit("leyline bench engine: --decode: must be >= 2")
    torch.set_num_threads(a.threads)
    if a.runner:
        return runner_main(a)
    dev = torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu"
    print(f"dtype {a.dtype}, {a.threads} thread(s), decode {a.decode} tokens, device {dev}")
    print(
        "| model | context | engine decode ms/tok | transformers decode ms/tok | speed-up "
        "| engine, torch attention ms/tok | engine, oneDNN linear ms/tok "
        "| engine prefill tok/s | transformers prefill tok/s | speed-up |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    shapes = _csv(a.shapes or a.archs)
    for arch in shapes:
        for n in map(int, _csv(a.contexts)):
            m = measure(arch, n, a.decode, a.dtype, a.device, a.small)
            print(
                f"| {_shape(arch)} | {n} | {m['engine_decode_ms']:.1f} | {m['hf_decode_ms']:.1f} "
                f"| {m['hf_decode_ms'] / m['engine_decode_ms']:.1f}x "
                f"| {_ms(m['torch_attn_decode_ms'])} | {_ms(m['onednn_linear_decode_ms'])} "
                f"| {m['engine_prefill_tps']:.0f} | {m['hf_prefill_tps']:.0f} "
                f"| {m['engine_prefill_tps'] / m['hf_prefill_tps']:.1f}x |",
                flush=True,
            )
    if a.clients:
        ctx, new = a.clients_context, a.clients_decode
        for arch in shapes:
            eng, alone, agg = concurrency(arch, a.clients, ctx, new, a.dtype, a.device, a.small)
            print(
                f"{_shape(arch)}, {ctx}-token prompts, {new} new tokens: one client "
                f"{alone:.1f} tok/s, {a.clients} concurrent {agg:.1f} tok/s aggregate "
                f"({agg / alone:.1f}x)",
                flush=True,
            )
            if eng.device.type == "cuda":
                one, many = hf_batches(eng, a.clients, ctx, new)
                print(
                    f"{_shape(arch)}, transformers generate, same prompts: batch 1 {one:.1f} "
                    f"tok/s, batch {a.clients} {many:.1f} tok/s aggregate; engine / "
                    f"transformers {alone / one:.2f}x and {agg / many:.2f}x",
                    flush=True,
                )
            del eng
    return 0


def _prompts(vocab: int, clients: int, ctx: int) -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(100, vocab) for _ in range(ctx)] for _ in range(clients + 1)]


def hf_batches(eng: Any, clients: int, ctx: int, decode: int) -> tuple[float, float]:
    """transformers' ``generate`` of the concurrency section's prompts (all of one length, so
    no padding): tokens/s of the lone prompt, then aggregate of ``clients`` in one batch."""
    import torch

    prompts = _prompts(eng.vocab_size, clients, ctx)
    out = []
    with torch.inference_mode():
        for batch in (prompts[-1:], prompts[:clients]):
            x = torch.tensor(batch, device=eng.device)
            _sync()
            t = time.perf_counter()
            eng.model.generate(
                x, max_new_tokens=decode, min_new_tokens=decode, do_sample=False, pad_token_id=0
            )
            _sync()
            out.append(len(batch) * decode / (time.perf_counter() - t))
    return out[0], out[1]


def concurrency(
    arch: str, clients: int, ctx: int, decode: int, dtype: str, device: str = "cpu",
    small: bool = False,
) -> tuple[Any, float, float]:  # fmt: skip
    """Aggregate tokens/s of one client alone, then of ``clients`` concurrent ``generate``
    calls (threads, as the server's worker with ``concurrency=clients`` runs them); the
    engine is returned for a comparison on the same model."""
    import threading

    from leyline_agent.engine.engine import SamplingParams

    from .shapes import engine_for

    budget = max(65536, (clients + 2) * (ctx + decode + 64))
    eng = engine_for(_shape(arch), device, dtype, budget, small)
    if eng.device.type == "cuda":  # first-call work off the clock
        eng.generate(list(range(100, 164)), SamplingParams(max_tokens=2, stop_token_ids=[]))
    prompts = _prompts(eng.vocab_size, clients, ctx)
    p = SamplingParams(max_tokens=decode, stop_token_ids=[])
    t = time.perf_counter()
    n1 = len(eng.generate(prompts[-1], p).output_ids)
    alone = n1 / (time.perf_counter() - t)
    counts = [0] * clients

    def run(i: int) -> None:
        counts[i] = len(eng.generate(prompts[i], p).output_ids)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(clients)]
    t = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return eng, alone, sum(counts) / (time.perf_counter() - t)


def runner_main(a: argparse.Namespace) -> int:
    print(f"dtype {a.dtype}, {a.threads} thread(s); median of 7 steps per row")
    print(f"read bandwidth (sum of a 256 MB fp32 tensor): {read_gbps():.1f} GB/s")
    print(
        "packed: the engine's default (oneDNN-packed linear weights for forwards of "
        "PACKED_MIN_ROWS rows or more, engine/model/linear.py); plain: "
        "Engine(packed_linears=False); the two steps interleaved"
    )
    print(
        "| model | batch | packed ms/step | tok/s vs batch 1 | plain ms/step "
        "| tok/s vs batch 1 | packed / plain |"
    )
    print("|---|---|---|---|---|---|---|")
    for arch in _csv(a.archs):
        rows = runner_scaling(arch, a.dtype, 512, (1, 2, 4, 8, 16))
        one = rows[0][1:]
        for b, packed, plain in rows:
            print(
                f"| {arch} mini | {b} | {packed:.1f} | {b * one[0] / packed:.2f}x "
                f"| {plain:.1f} | {b * one[1] / plain:.2f}x | {packed / plain:.2f} |",
                flush=True,
            )
    return 0


def read_gbps() -> float:
    import torch

    x = torch.randn(64 << 20)
    x.sum()
    t = time.perf_counter()
    for _ in range(5):
        x.sum()
    return 5 * x.numel() * 4 / (time.perf_counter() - t) / 1e9


def runner_scaling(
    arch: str, dtype: str, ctx: int, sizes: tuple[int, ...]
) -> list[tuple[int, float, float]]:
    """ms per decode step of one packed forward of b sequences, each over ``ctx`` cached
    rows in one run of the pool: the model's own batch scaling, no scheduler or threads.
    Two engines on the same checkpoint, linear weights packed and plain, their steps
    interleaved: ``(b, packed ms, plain ms)``."""
    from leyline_agent.engine.checkpoints.store import model_dir
    from leyline_agent.engine.engine import Engine
    from leyline_agent.engine.model.runner import StepInput

    engines = [
        Engine.from_pretrained(model_dir(arch, "mini"), dtype=dtype, packed_linears=packed)
        for packed in (True, False)
    ]
    rng = random.Random(3)
    vocab = engines[0].vocab_size
    seqs: list[list[list[int]]] = [[], []]
    for _ in range(max(sizes)):
        ids = [rng.randrange(100, vocab) for _ in range(ctx)]
        for eng, mine in zip(engines, seqs, strict=True):
            slots = eng.runner.allocator.alloc(ctx + 1)
            eng.runner.run([StepInput(ids, slots[:ctx])])
            mine.append(slots)
    out = []
    for b in sizes:
        times: list[list[float]] = [[], []]
        for _ in range(8):
            tok = [rng.randrange(100, vocab) for _ in range(b)]
            for eng, mine, ts in zip(engines, seqs, times, strict=True):
                batch = [StepInput([t], s) for t, s in zip(tok, mine[:b], strict=True)]
                t0 = time.perf_counter()
                eng.runner.run(batch)
                ts.append(time.perf_counter() - t0)
        packed, plain = (1e3 * sorted(ts[1:])[3] for ts in times)
        out.append((b, packed, plain))
    return out


if __name__ == "__main__":
    raise SystemExit(standalone(add_arguments, main))
