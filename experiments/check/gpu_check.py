"""``leyline check gpu OUTDIR [--dry-run]``: the prepared check for a lent GPU machine.

Run by ``scripts/gpu_check.sh`` (which assembles the project there first). The sections, in
order of value, each recorded as soon as it ends in ``OUTDIR/<section>/report.json`` (the form
``leyline bench report`` renders), so a run cut short keeps what it finished:

- ``kernel``: the Triton ``rotate_band`` against a float64 rotation written from scratch
  (``reference.rope_float64``; GQA 8 x 128 half-split and MLA 576-wide band 64 at 512
  interleaved; fp32 and bf16; copy and in-place plans), then ``bench_kernel`` (its bandwidth
  against a plain device copy of the same bytes);
- ``vllm-rows``: the vLLM plugin's row moves (``paged_rows.move_rows``: read, the band turned
  with the project's kernel, written) on caches laid out in each of vLLM 0.32's
  ``KVCacheLayout`` orders, GQA K|V and MLA latent rows, against float64 RoPE
  (``vllm_rows.check``; vLLM itself does not travel there);
- ``engine-mini``: both ``mini`` models (fp32) on the device against transformers on the same
  device (prefill logits, FORGET logits against a from-scratch forward of T', greedy tokens
  against ``generate``) and against the CPU engine (AMORTIZE logits);
- ``engine``: ``bench engine`` on the 1B llama shape, bf16: prefill against transformers'
  forward at 8k / 33k / 66k, decode ms/token, and 8 concurrent 2k-token requests;
- ``splice-1b`` / ``splice-mla``: ``bench splice`` (AMORTIZE, FORGET, a forward) on the 1B
  llama shape at 33k and 66k tokens, and on a 4-layer DeepSeek-V2-Lite MLA shape at 33k, bf16.

A section that fails prints its traceback into its record and the check goes on; the exit
status says whether every section passed. A section that would start after ``--budget-s``
seconds is skipped (and says so), so the check ends inside a lent machine's time. ``--dry-run``: the same code on the CPU with
shrunk shapes and small sizes (seconds), the suite's test of this script.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import importlib
import os
import shlex
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..options import parse

__all__ = ["SECTIONS", "add_arguments", "main"]

SECTIONS = ("kernel", "vllm-rows", "engine-mini", "engine", "splice-1b", "splice-mla")
EXTRA = ("profile",)  # on demand (--sections profile): where the engine's time goes


def _argv(full: list[str], dry: list[str]) -> Callable[[bool], list[str]]:
    return lambda dry_run: dry if dry_run else full


# The benchmarks' own options per section: (on the device, in a dry run).
KERNEL_ARGS = _argv(
    ["--device", "cuda", "--rows", "4096,32768,262144"],
    ["--device", "cpu", "--rows", "256", "--layers", "2"],
)
ENGINE_ARGS = _argv(
    ["--shapes", "llama-1b", "--device", "cuda", "--dtype", "bfloat16",
     "--contexts", "2048,8192,33792,66560", "--decode", "64", "--clients", "8",
     "--clients-context", "2048", "--clients-decode", "128"],
    ["--shapes", "llama-1b", "--device", "cpu", "--dtype", "bfloat16", "--small",
     "--contexts", "96", "--decode", "2", "--clients", "2", "--clients-context", "32",
     "--clients-decode", "2"],
)  # fmt: skip
SPLICE_1B_ARGS = _argv(
    ["--shapes", "llama-1b", "--device", "cuda", "--dtype", "bfloat16",
     "--halves", "16384,32768", "--reps", "3", "--forget-reps", "1"],
    ["--shapes", "llama-1b", "--device", "cpu", "--dtype", "bfloat16", "--small",
     "--halves", "64", "--span", "16", "--replacement", "4", "--reps", "1"],
)  # fmt: skip
SPLICE_MLA_ARGS = _argv(
    ["--shapes", "dsv2-lite", "--device", "cuda", "--dtype", "bfloat16",
     "--halves", "16384", "--reps", "3", "--forget-reps", "1"],
    ["--shapes", "dsv2-lite", "--device", "cpu", "--dtype", "bfloat16", "--small",
     "--halves", "64", "--span", "16", "--replacement", "4", "--reps", "1"],
)  # fmt: skip


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The flags (stdlib only: the CLI builds its parser without importing torch)."""
    ap.add_argument("out", type=Path, help="output folder: one <section>/report.json each")
    ap.add_argument("--dry-run", action="store_true", help="CPU, shrunk shapes, small sizes")
    ap.add_argument("--sections", default=",".join(SECTIONS), help="comma list of sections")
    ap.add_argument("--budget-s", type=float, default=420.0, help="start no section after this")


def main(a: argparse.Namespace) -> int:
    import torch

    dry = a.dry_run
    if not dry and not torch.cuda.is_available():
        raise SystemExit("leyline check gpu: no CUDA device here (--dry-run runs on the CPU)")
    device = "cpu" if dry else "cuda"
    name = "cpu (dry run)" if dry else torch.cuda.get_device_name()
    commit = os.environ.get("LEYLINE_COMMIT") or None  # set by gpu_check.sh off the checkout
    runs = {
        "kernel": _kernel, "vllm-rows": _vllm_rows, "engine-mini": _engine_mini,
        "engine": _bench("engine", "bench_engine", ENGINE_ARGS),
        "splice-1b": _bench("splice", "bench_splice", SPLICE_1B_ARGS),
        "splice-mla": _bench("splice", "bench_splice", SPLICE_MLA_ARGS),
        "profile": _profile,
    }  # fmt: skip
    sections = [s for s in a.sections.split(",") if s]
    for section in sections:
        if section not in runs:
            names = ", ".join(SECTIONS + EXTRA)
            raise SystemExit(f"--sections: {section!r} is not one of {names}")
    failed, t0 = [], time.monotonic()
    for section in sections:
        if time.monotonic() - t0 > a.budget_s:
            print(f"== check gpu: {section} SKIPPED: past --budget-s {a.budget_s:.0f} s")
            failed.append(section)
            continue
        ok = _record(a.out / section, section, runs[section], device, dry, name, commit)
        if not ok:
            failed.append(section)
    print(f"check gpu: {len(failed)} section(s) failed{': ' + ', '.join(failed) if failed else ''}")
    return 1 if failed else 0


def _record(
    out: Path, section: str, fn: Callable[[str, bool], str], device: str, dry: bool,
    name: str, commit: str | None,
) -> bool:  # fmt: skip
    """Run one section with its output captured and write its record, failed or not."""
    from ..reports.results import Tee, load_average, write_record

    started, load_before, tee = dt.datetime.now(dt.UTC), load_average(), Tee(sys.stdout)
    ok, command = True, ""
    print(f"== check gpu: {section} on {name}", flush=True)
    with contextlib.redirect_stdout(tee):
        try:
            command = fn(device, dry)
        except Exception:  # a failed section is recorded with its traceback; the rest runs
            ok = False
            print(f"FAILED: {section}\n{traceback.format_exc()}", flush=True)
    extra: dict[str, Any] = {"device": name, "passed": ok}
    if commit:
        extra["commit"] = commit
    cmd = f"scripts/gpu_check.sh OUT{' --dry-run' if dry else ''} (section {section}: {command})"
    write_record(out, "check gpu", cmd, started, load_before, tee.copy.getvalue(), **extra)
    return ok


# ---------------------------------------------------------------------------- sections
def _kernel(device: str, dry: bool) -> str:
    _kernel_exactness(device)
    from ..bench.bench_kernel import main as bench_kernel

    args = KERNEL_ARGS(dry)
    bench_kernel(args)
    return "python experiments/bench/bench_kernel.py " + shlex.join(args)


def _vllm_rows(device: str, dry: bool) -> str:
    from ..bench.vllm_rows import check

    blocks = 4 if dry else 8
    check(device, blocks=blocks)
    return f"experiments/bench/vllm_rows.py: check({device!r}, blocks={blocks})"


def _bench(verb: str, module: str, argv: Callable[[bool], list[str]]) -> Callable[[str, bool], str]:
    """A section that runs ``leyline bench <verb>`` (``bench/<module>.py``) on ``argv(dry)``."""

    def run(device: str, dry: bool) -> str:
        bench = importlib.import_module(f"..bench.{module}", __package__)
        args = argv(dry)
        rc = bench.main(parse(bench.add_arguments, args))
        if rc:
            raise RuntimeError(f"bench {verb} exited {rc}")
        return f"leyline bench {verb} " + shlex.join(args)

    return run


def _kernel_exactness(device: str) -> None:
    """Keys rotated to positions p by the float64 truth, stored in the buffer's dtype, turned
    by delta with the kernel (the device's default backend: Triton on CUDA); the result
    against the float64 truth at p + delta. Rows outside ``dst`` must be unchanged."""
    import torch

    from leyline_agent.kernels import RopeSpec, rotate_band
    from leyline_agent.kernels.reference import rope_float64

    print("rotate_band against a float64 rotation: max abs error, and rel-L2 of the rotated "
          "rows against the truth (the stored inputs' rounding included)")  # fmt: skip
    print("| layout | dtype | plan | rows | backend | max abs err | rel-L2 | others unchanged |")
    print("|---|---|---|---|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    cases = [("gqa 8x128 half", 8, 128, 0, 64, "half"), ("mla 576 band 64@512", 1, 576, 512, 32,
                                                            "interleaved")]  # fmt: skip
    for label, heads, width, off, half, layout in cases:
        inv = 10000.0 ** -(torch.arange(half, dtype=torch.float64) / half)
        spec = RopeSpec(inv_freq=tuple(inv.float().tolist()), rotary_dim=2 * half, layout=layout)
        inv32 = torch.tensor(spec.inv_freq, dtype=torch.float64)
        rows, delta = 1000, -240
        pos = torch.arange(rows, dtype=torch.float64) + 5000
        for dtype in (torch.float32, torch.bfloat16):
            for plan in ("copy", "in-place"):
                keys = torch.randn(heads, width, generator=g, dtype=torch.float64)
                truth = torch.stack([rope_float64(k, pos, inv32, layout, off) for k in keys])
                after = torch.stack(
                    [rope_float64(k, pos + delta, inv32, layout, off) for k in keys]
                )
                buf = torch.zeros(heads, 2 * rows, width, dtype=dtype)
                buf[:, :rows] = truth.to(dtype)
                buf = buf.to(device)
                before = buf.clone()
                src = torch.arange(rows, device=device)
                dst = src + rows if plan == "copy" else src
                rotate_band(buf, src, dst, delta, spec, off)
                got = buf[:, dst].double().cpu()
                err = (got - after).abs()
                rel = float((got - after).norm() / after.norm())
                mask = torch.ones(2 * rows, dtype=torch.bool)
                mask[dst.cpu()] = False
                untouched = bool(torch.equal(buf.cpu()[:, mask], before.cpu()[:, mask]))
                backend = "triton" if buf.device.type == "cuda" else "cpu default"
                print(
                    f"| {label} | {str(dtype)[6:]} | {plan} | {rows} | {backend} "
                    f"| {err.max():.2e} | {rel:.2e} | {untouched} |",
                    flush=True,
                )
                if not untouched:
                    raise AssertionError(f"{label} {dtype} {plan}: rows outside dst changed")


def _engine_mini(device: str, dry: bool) -> str:
    """Both ``mini`` models in fp32, and llama's in bf16 (on CUDA its chunks after cached rows
    take the flash path, ``attention._flash``): the engine on ``device`` against transformers
    there (the same dtype) and against the CPU engine."""
    import random

    import torch

    from leyline_agent.engine.checkpoints.store import model_dir
    from leyline_agent.engine.engine import Engine, SamplingParams
    from leyline_agent.wire import DirectivesRequest

    _extend_check(device, dry)
    n, span, new = (96, 16, 4) if dry else (2048, 256, 16)
    print(f"mini models, {n}-token context, a {span}-token span replaced by 4 tokens")
    print("| model | dtype | prefill logits vs transformers | FORGET logits vs transformers on T' "
          "| AMORTIZE logits vs CPU engine | greedy tokens = transformers generate |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for arch, dtype in (("deepseek_v2", "float32"), ("llama", "float32"), ("llama", "bfloat16")):
        path = model_dir(arch, "mini", 0)
        rng = random.Random(1)
        kw: dict[str, Any] = {"dtype": dtype, "cache_budget_tokens": 4 * n}
        eng = Engine.from_pretrained(path, device=device, **kw)
        cpu = Engine.from_pretrained(path, device="cpu", **kw)
        T = [rng.randrange(100, eng.vocab_size) for _ in range(n)]
        R = [rng.randrange(100, eng.vocab_size) for _ in range(4)]
        X = [rng.randrange(100, eng.vocab_size) for _ in range(8)]
        s, e = n // 2, n // 2 + span
        Tp = T[:s] + R + T[e:]

        def hf_last(ids: list[int], eng: Any = eng) -> torch.Tensor:
            with torch.inference_mode():
                x = torch.tensor([ids], device=eng.device)
                return eng.model(input_ids=x, logits_to_keep=1).logits[0, -1].float().cpu()

        def diff(a: torch.Tensor, b: torch.Tensor) -> str:
            return f"{(a.float().cpu() - b.float().cpu()).abs().max():.2e}"

        pre = diff(eng.logits_for(T + X), hf_last(T + X))
        amort = []
        for engine in (eng, cpu):
            engine.generate(T, SamplingParams(max_tokens=0))
            d = {"start": s, "end": e, "replacement": R, "mode": "amortize"}
            resp = engine.apply_directives(DirectivesRequest(tokens=T, directives=[d]))
            amort.append(engine.logits_for(list(resp.tokens) + X))
        d = {"start": s, "end": e, "replacement": R, "mode": "forget"}
        eng.apply_directives(DirectivesRequest(tokens=T, directives=[d]))
        forget = diff(eng.logits_for(Tp + X), hf_last(Tp + X))
        out = eng.generate(T + X, SamplingParams(max_tokens=new, stop_token_ids=[])).output_ids
        with torch.inference_mode():
            x = torch.tensor([T + X], device=eng.device)
            ref = eng.model.generate(
                x, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0
            )[0, x.shape[1]:].tolist()  # fmt: skip
        print(
            f"| {arch} mini | {dtype} | {pre} | {forget} | {diff(amort[0], amort[1])} "
            f"| {list(out) == ref} ({new} tokens) |",
            flush=True,
        )
        del eng, cpu
    return "(engine-mini: in experiments/check/gpu_check.py)"


def _extend_check(device: str, dry: bool) -> None:
    """A chunk after cached rows (``attention._gqa_extend``, bf16; on CUDA the flash path)
    against a float64 softmax over the rows gathered from the pool, masked from the bottom
    right. Where it errs or raises, the later sections run with the flash path off
    (``USE_FLASH_EXTEND = False``), and this says so."""
    import torch

    from leyline_agent.engine.model import attention
    from leyline_agent.engine.model.context import SeqRows
    from leyline_agent.engine.model.runner import slot_runs

    g = torch.Generator().manual_seed(0)
    h, kvh, d, t, dt = 32, 8, 128, (32 if dry else 512), torch.bfloat16
    print("chunk after cached rows vs float64 over gathered rows (GQA 32/8 x 128, bf16)")
    print("| cached rows | runs | path | max abs err | ok |")
    print("|---|---|---|---|---|")
    for cached, runs in ((256, 1), (256, 3)) if dry else ((4096, 1), (4096, 3)):
        pk = torch.randn(kvh, 3 * cached + t, d, generator=g).to(dt).to(device)
        pv = torch.randn(kvh, 3 * cached + t, d, generator=g).to(dt).to(device)
        part = cached // runs
        slots = torch.cat(
            [torch.arange(i * 2 * part, i * 2 * part + part) for i in range(runs)]
            + [torch.arange(3 * cached, 3 * cached + t)]
        )
        s = SeqRows(0, t, slots.to(device), slot_runs(slots))
        q = torch.randn(1, h, t, d, generator=g).to(dt).to(device)
        path = {"cuda": "flash", "cpu": "cpu flash"}.get(attention.flash_path(q), "dense")
        try:
            got = attention.extend_attention(q, pk, pv, s, d**-0.5).double().cpu()
            k = pk[:, slots.to(device)].double().cpu().repeat_interleave(h // kvh, 0)
            v = pv[:, slots.to(device)].double().cpu().repeat_interleave(h // kvh, 0)
            n = k.shape[1]
            sc = q[0].double().cpu() @ k.transpose(1, 2) * d**-0.5
            seen = torch.arange(n)[None, :] <= torch.arange(n - t, n)[:, None]
            want = (sc.masked_fill(~seen, float("-inf")).softmax(-1) @ v).transpose(0, 1)
            err = float((got - want).abs().max())
            ok = err < 3e-2
            print(f"| {cached} | {runs} | {path} | {err:.2e} | {ok} |", flush=True)
        except Exception as e:  # the flash op refused: recorded, and the path switched off
            ok = False
            print(f"| {cached} | {runs} | {path} | {type(e).__name__}: {e} | False |")
        if not ok and attention.USE_FLASH_EXTEND and path == "flash":
            attention.USE_FLASH_EXTEND = False
            print("FLASH EXTEND OFF for the rest of this check (LEYLINE_FLASH_EXTEND=0)")


# ---------------------------------------------------------------------------- profile
_SYNC_OPS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "aten::_local_scalar_dense",
             "aten::nonzero", "cudaMemcpyAsync")  # fmt: skip


def _profile(device: str, dry: bool) -> str:
    """Where the engine's time goes on the 1B llama shape, bf16: a prefill (the runner's own
    chunks, in this thread) beside transformers' forward, decode steps of the runner alone
    beside ``Engine.generate``'s per-token time (the difference: the step loop), and one
    AMORTIZE (its host side; R's prefill runs on the step thread). Each with torch.profiler's
    top ops by self CPU time and the calls that wait for the device."""
    import random

    import torch
    from torch.profiler import ProfilerActivity, profile

    from leyline_agent.engine.engine import SamplingParams
    from leyline_agent.engine.model.runner import StepInput
    from leyline_agent.wire import DirectivesRequest

    from ..bench.shapes import engine_for

    n, dec, half = (256, 4, 64) if dry else (33792, 32, 16384)
    eng = engine_for("llama-1b", device, "bfloat16", 4 * n + 4096, small=dry)
    rng = random.Random(0)
    ids = [rng.randrange(100, eng.vocab_size) for _ in range(n)]
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    def timed(fn: Any) -> float:
        sync()
        t = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - t

    def show(label: str, prof: Any, per: int = 1) -> None:
        ev = prof.key_averages()
        waits = {e.key: e.count for e in ev if e.key in _SYNC_OPS}
        launches = sum(e.count for e in ev if e.key in ("cudaLaunchKernel", "cuLaunchKernel",
                                                         "cudaLaunchKernelExC"))  # fmt: skip
        print(f"{label}: kernel launches {launches}, waits {waits} (per {per} unit(s))")
        print("| op | calls | self CPU ms | device ms |")
        print("|---|---|---|---|")
        top = sorted(ev, key=lambda e: -e.self_cpu_time_total)[:14]
        by_dev = sorted(ev, key=lambda e: -getattr(e, "self_device_time_total", 0.0))[:8]
        for e in top + [e for e in by_dev if e not in top and device == "cuda"]:
            dev_us = getattr(e, "self_device_time_total", 0.0)
            print(f"| {e.key[:60]} | {e.count} | {e.self_cpu_time_total / 1e3:.1f} "
                  f"| {dev_us / 1e3:.1f} |")  # fmt: skip

    # prefill: warm, then timed and profiled, transformers beside it
    with torch.inference_mode():
        warm = ids[:1024]
        eng.allocator.free(eng.runner.prefill([], warm, want_logits=True)[0])
        eng.model(input_ids=torch.tensor([warm], device=eng.device), logits_to_keep=1)
        x = torch.tensor([ids], device=eng.device)
        hf_s = timed(lambda: eng.model(input_ids=x, logits_to_keep=1))
        slots: list[int] = []
        e_s = timed(lambda: slots.extend(eng.runner.prefill([], ids, want_logits=True)[0]))
        eng.allocator.free(slots)
        print(
            f"prefill {n} tokens: runner {e_s * 1e3:.0f} ms (chunk {eng.runner.chunk}), "
            f"transformers forward {hf_s * 1e3:.0f} ms, runner/transformers {e_s / hf_s:.2f}x"
        )
        with profile(activities=acts) as prof:
            fresh = eng.runner.prefill([], ids, want_logits=True)[0]
            sync()
        show(f"prefill {n} tokens (runner)", prof)
        # decode steps of the runner alone, over the prompt just prefilled (batch 1)
        rows = eng.allocator.alloc(dec)
        tok = [rng.randrange(100, eng.vocab_size) for _ in range(dec)]

        def steps() -> None:
            for i in range(dec):
                logits = eng.runner.run([StepInput([tok[i]], fresh + rows[: i + 1])])
                int(torch.argmax(logits[0]))

        steps()
        step_s = timed(steps) / dec
        with profile(activities=acts) as prof:
            steps()
        eng.allocator.free(fresh + rows)
    p = SamplingParams(max_tokens=dec + 1, stop_token_ids=[])
    short = ids[:2048]
    eng.generate(short, p)
    r = eng.generate(short[:-1] + [short[0]], p)
    gen_s = (r.e2e_s - r.ttft_s) / max(1, len(r.output_ids) - 1)
    print(
        f"decode, batch 1, {len(fresh)}-token context: runner step {step_s * 1e3:.1f} ms; "
        f"Engine.generate at 2048 tokens {gen_s * 1e3:.1f} ms/token"
    )
    show(f"decode ({dec} runner steps)", prof, dec)
    # one AMORTIZE at 2 * half + 256 tokens
    T = [rng.randrange(100, eng.vocab_size) for _ in range(2 * half + 256)]
    R = [rng.randrange(100, eng.vocab_size) for _ in range(16)]
    eng.generate(T, SamplingParams(max_tokens=0))

    def amortize() -> None:
        d = {"start": half, "end": half + 256, "replacement": R, "mode": "amortize"}
        eng.apply_directives(DirectivesRequest(tokens=T, directives=[d]))

    amortize()
    a_s = timed(amortize)
    with profile(activities=acts) as prof:
        amortize()
        sync()
    print(f"AMORTIZE at {len(T)} tokens: {a_s * 1e3:.1f} ms")
    show("AMORTIZE (the calling thread)", prof)
    return "(profile: in experiments/check/gpu_check.py)"
