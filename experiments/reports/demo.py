"""``leyline demo``: the main job on a fresh machine.

1. the ``mini`` model (``leyline make-model --size mini``) under ``--models-dir``, built once;
2. the mechanism benchmark, ``--quick`` (C = 1 and 4, 4 sessions x 10 turns, all arms);
3. the correctness report (3 prompts, 16 chained splices);
then a short table and the plot paths; then the real-model section (``demo_real``: SmolLM2,
fetched on first use, the quick quality report and one chat through a splice; skipped with
``--no-real-model``). Everything lands under ``--out``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

__all__ = ["add_arguments", "main", "run_demo"]

DEMO_CONCURRENCY = [1, 4]


def ensure_model(models_dir: Path, arch: str, size: str = "mini") -> Path:
    from leyline_agent.engine.checkpoints.modelgen import make_model

    path = models_dir / f"{arch}-{size}"
    if not (path / "config.json").is_file():
        print(f"creating the {size} model ({arch}) in {path} ...", flush=True)
        make_model(arch, size, path, seed=0)
    return path


def run_demo(
    out: Path,
    models_dir: Path,
    arch: str = "deepseek_v2",
    size: str = "mini",
    concurrency: list[int] | None = None,
    prompts: int = 3,
    chain: int = 16,
    progress: bool = True,
    **bench_overrides: Any,
) -> dict[str, Any]:
    from ..bench.mechanism import BenchSettings, run_mechanism
    from ..check.correctness import run_correctness, summary_lines
    from ..replay.replay import ARMS

    t0 = time.perf_counter()
    model = ensure_model(models_dir, arch, size)
    t1 = time.perf_counter()
    st = BenchSettings.make(concurrency or DEMO_CONCURRENCY, list(ARMS), quick=True, reps=1)
    for k, v in bench_overrides.items():  # e.g. sessions=2, max_turns=3 (tests)
        setattr(st, k, v)
    rows = run_mechanism(model, st, out / "mechanism", progress=progress)
    t2 = time.perf_counter()
    report = run_correctness(model, out / "correctness", prompts=prompts, max_chain=chain)
    t3 = time.perf_counter()
    return {
        "model": model,
        "rows": rows,
        "report": report,
        "summary": summary_lines(report),
        "timings_s": {"model": t1 - t0, "mechanism": t2 - t1, "correctness": t3 - t2},
    }


def _table(rows: list[dict[str, Any]]) -> str:
    full = {r["concurrency"]: r for r in rows if r["arm"] == "full"}
    lines = ["arm      C  hit rate  prefilled  vs full  TTFT p50 s  e2e p50 s  splices"]
    for r in sorted(rows, key=lambda r: (r["concurrency"], r["arm"])):
        base = full.get(r["concurrency"])
        ratio = f"{r['prefilled_tokens'] / base['prefilled_tokens']:.2f}x" if base else "-"
        sp = r["splices"]
        lines.append(
            f"{r['arm']:<8} {r['concurrency']:>2}  {r['hit_rate']:8.3f}  {r['prefilled_tokens']:9.0f}"
            f"  {ratio:>7}  {r['ttft_p50_s']:10.3f}  {r['e2e_p50_s']:9.3f}"
            f"  {sp['amortize']:.0f}a/{sp['forget']:.0f}f"
        )
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, default=Path("runs/demo"), help="output folder")
    p.add_argument(
        "--models-dir", type=Path, default=Path(".leyline/models"), help="where models are built"
    )
    p.add_argument("--arch", default="deepseek_v2", help="model architecture (make-model --arch)")
    p.add_argument("--size", default="mini", choices=["tiny", "mini"], help="model size")
    p.add_argument("--no-real-model", dest="real_model", action="store_false",
                   help="skip the real-model section (SmolLM2: quick quality report, a spliced chat)")  # fmt: skip


def main(args: argparse.Namespace) -> int:
    res = run_demo(args.out, args.models_dir, args.arch, args.size)
    t = res["timings_s"]
    print()
    print(f"Leyline demo — model {res['model']}")
    print(_table(res["rows"]))
    print()
    print("\n".join(res["summary"]))
    print()
    print(
        f"mechanism:   {args.out / 'mechanism' / 'results.md'}  plot {args.out / 'mechanism' / 'results.png'}"
    )
    print(
        f"correctness: {args.out / 'correctness' / 'correctness.json'}  plot {args.out / 'correctness' / 'correctness.png'}"
    )
    print(
        f"time: model {t['model']:.0f}s, mechanism {t['mechanism']:.0f}s, correctness {t['correctness']:.0f}s"
    )
    if getattr(args, "real_model", True):
        from .demo_real import real_model_section

        t4 = time.perf_counter()
        lines = real_model_section(args.out / "real-model")
        print()
        print("\n".join(lines))
        print(f"time: real model {time.perf_counter() - t4:.0f}s")
    return 0
