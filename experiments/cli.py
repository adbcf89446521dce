"""CLI verbs of the experiments layer.

    leyline bench mechanism      replay trajectories against the runtime, arms interleaved
    leyline bench splice|soak|soak-hostile|drift|splice-stream|directive  modules with their own
                                 options (-h), recorded
    leyline bench report         every recorded run (runs/**/report.json) into docs/results.md
    leyline check correctness    first-token agreement and bf16 drift of splices
    leyline check quality        real model: first token, greedy answers, fact recall per arm
    leyline check bf16           real model: bf16 logits error, key drift, cache-state dependence
    leyline check gpu OUTDIR     the prepared GPU check (scripts/gpu_check.sh; --dry-run on CPU)
    leyline eval mini-nightmare  debug-gym's froggy through Leyline, per arm
    leyline demo                 mini model + quick mechanism benchmark + correctness report
    leyline trajectories generate  realistic agent trajectories from the mini_nightmare tasks

Registration imports nothing heavy; each handler imports its module when it runs.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from pathlib import Path

from .reports.results import recorded


def _csv_ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from e
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def register(sub: argparse._SubParsersAction) -> None:
    """Add this layer's verbs to the ``leyline`` parser."""
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", metavar="WHAT")
    p = bench.add_parser("mechanism", help="replay hit rate and latency of splice vs prefix cache")
    p.add_argument("--model", required=True, help="model folder (leyline make-model)")
    p.add_argument("--concurrency", type=_csv_ints, default=[1, 4, 8, 16], help="e.g. 1,4,8,16")
    p.add_argument(
        "--arms", default="full,radix,splice,forget,nocache", help="comma list of replay arms"
    )
    p.add_argument("--out", type=Path, default=Path("runs/mechanism"), help="output folder")
    p.add_argument("--quick", action="store_true", help="reduced set (~2 min on 2 cores, mini)")
    p.add_argument("--reps", type=int, default=None, help="repetitions (default 3, quick 1)")
    p.add_argument(
        "--trajectories",
        type=Path,
        default=None,
        help="JSONL of trajectories to replay (default: generated)",
    )
    p.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16"], help="model dtype"
    )
    p.add_argument(
        "--config", type=Path, default=None, help="YAML settings (configs/runs/mechanism-*.yaml)"
    )
    p.set_defaults(func=recorded("bench mechanism", _bench_mechanism, Path("runs/mechanism")))

    p = bench.add_parser(
        "side-by-side", help="HTTP replay: vanilla vLLM, vLLM + Leyline, leyline serve"
    )
    p.add_argument(
        "--model", required=True, help="model folder (leyline make-model), e.g. llama mini"
    )
    p.add_argument(
        "--targets", default="vllm,vllm-leyline,leyline", help="comma list of servers to compare"
    )
    p.add_argument(
        "--concurrency", type=_csv_ints, default=[1, 4, 8, 16], help="comma list of C values"
    )
    p.add_argument("--sessions", type=int, default=None, help="sessions per run (default max C)")
    p.add_argument("--max-turns", type=int, default=None, help="turns per session (quick: 6)")
    p.add_argument(
        "--quick", action="store_true", help="tool outputs cut to 400 chars, no tool schemas"
    )
    p.add_argument(
        "--trajectories", type=Path, default=None, help="JSONL to replay (default: generated)"
    )
    p.add_argument(
        "--count", action="store_true",
        help="print the tokens one run replays and must prefill (no server) and exit",
    )  # fmt: skip
    p.add_argument("--out", type=Path, default=Path("runs/side-by-side"), help="output folder")
    p.set_defaults(
        func=recorded("bench side-by-side", _bench_side_by_side, Path("runs/side-by-side"))
    )

    p = bench.add_parser("http", help="HTTP replay against any OpenAI-compatible endpoint")
    p.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8080/v1")
    p.add_argument("--served-model", required=True, help="the model name the endpoint serves")
    p.add_argument("--label", default="endpoint", help="name of the endpoint in the table")
    p.add_argument("--arms", default="radix", help="radix, splice (needs /leyline/v1), full")
    p.add_argument(
        "--concurrency", type=_csv_ints, default=[1, 4, 8, 16], help="comma list of C values"
    )
    p.add_argument("--sessions", type=int, default=None, help="sessions per run (default max C)")
    p.add_argument("--max-turns", type=int, default=None, help="turns per session (quick: 6)")
    p.add_argument(
        "--quick", action="store_true", help="tool outputs cut to 400 chars, no tool schemas"
    )
    p.add_argument(
        "--trajectories", type=Path, default=None, help="JSONL to replay (default: generated)"
    )
    p.add_argument("--out", type=Path, default=Path("runs/http"), help="output folder")
    p.set_defaults(func=recorded("bench http", _bench_http, Path("runs/http")))

    from .bench.bench_engine import add_arguments as bench_engine_arguments  # stdlib only

    p = bench.add_parser(
        "engine", help="engine vs transformers generate: decode/prefill by context, concurrency"
    )
    bench_engine_arguments(p)
    p.set_defaults(func=recorded("bench engine", _bench_engine, Path("runs/engine")))

    from .bench.bench_serve import add_arguments as bench_serve_arguments  # stdlib only

    p = bench.add_parser("serve", help="leyline serve: aggregate tok/s of C streaming clients")
    bench_serve_arguments(p)
    p.set_defaults(func=recorded("bench serve", _bench_serve, Path("runs/serve")))

    for verb, module, help_text in (
        ("splice", "bench.bench_splice", "splice vs FORGET vs a forward, in-process (mini models)"),
        ("soak", "bench.soak_rss", "RSS of leyline serve over rounds of streaming clients"),
        ("soak-hostile", "bench.soak_hostile", "normal clients' latency beside hostile ones, 5xx, RSS"),
        ("store-budget", "bench.store_budget", "Responses store: RSS under 1 MB inputs, stats, flush"),
        ("drift", "bench.bench_drift", "reasoning-agent replay: plain cache, drift splices, kept"),
        ("splice-stream", "bench.bench_splice_stream", "a stream's gaps while another session splices"),
        ("directive", "bench.bench_directive", "one directive's cost over HTTP, on every server"),
    ):
        p = bench.add_parser(verb, help=help_text, add_help=False)
        p.set_defaults(
            func=recorded(f"bench {verb}", _module_main(module), Path(f"runs/{verb}")),
            passthrough=[],  # the module's own options (``leyline bench splice -h``)
        )

    p = bench.add_parser("report", help="render every runs/**/report.json into docs/results.md")
    p.add_argument("--runs", type=Path, default=Path("runs"), help="where the records are")
    p.add_argument("--to", type=Path, default=Path("docs/results.md"), help="the page to write")
    p.set_defaults(func=_bench_report)

    from .bench.bench_grammar import add_arguments as bench_grammar_arguments  # stdlib only

    p = bench.add_parser("grammar", help="constrained decoding: ms/token with and without a grammar")
    bench_grammar_arguments(p)
    p.set_defaults(func=recorded("bench grammar", _module_main("bench.bench_grammar", whole=True),
                                 Path("runs/grammar")))  # fmt: skip

    check = sub.add_parser("check", help="correctness reports").add_subparsers(
        dest="check", metavar="WHAT"
    )
    from .check.gpu_check import add_arguments as gpu_check_arguments  # stdlib only

    p = check.add_parser("gpu", help="the prepared GPU check (scripts/gpu_check.sh runs it)")
    gpu_check_arguments(p)
    p.set_defaults(func=_module_main("check.gpu_check", whole=True))
    p = check.add_parser("correctness", help="splice vs full context: argmax agreement, bf16 drift")
    p.add_argument("--model", required=True, help="model folder")
    p.add_argument("--out", type=Path, default=Path("runs/correctness"), help="output folder")
    p.add_argument("--prompts", type=int, default=8, help="prompts for the argmax agreement")
    p.add_argument("--max-chain", type=int, default=64, help="longest chain of splices (drift)")
    p.add_argument("--quick", action="store_true", help="fewer prompts and a shorter chain")
    p.set_defaults(
        func=recorded("check correctness", _check_correctness, Path("runs/correctness"))
    )

    from .check.quality import add_arguments as quality_arguments  # no torch at import

    p = check.add_parser("quality", help="real model: FULL vs FORGET vs a splice on agent conversations")
    quality_arguments(p)
    p.set_defaults(func=recorded("check quality", _module_main("check.quality", whole=True),
                                 Path("runs/quality")))  # fmt: skip

    from .check.bf16_facts import add_arguments as bf16_arguments  # no torch at import

    p = check.add_parser("bf16", help="real model: bf16 logits error, key drift, cache-state dependence")
    bf16_arguments(p)
    p.set_defaults(func=recorded("check bf16", _module_main("check.bf16_facts", whole=True), Path("runs/bf16")))

    ev = sub.add_parser("eval", help="agent evaluations").add_subparsers(
        dest="eval", metavar="WHAT"
    )
    p = ev.add_parser("mini-nightmare", help="debug-gym mini_nightmare, froggy through Leyline")
    p.add_argument(
        "--base-url",
        required=True,
        help="OpenAI-compatible endpoint, e.g. http://127.0.0.1:30000/v1",
    )
    p.add_argument("--model", required=True, help="served model name")
    p.add_argument(
        "--tokenizer",
        default=None,
        help="local HF tokenizer folder for debug-gym's token counting (default: --model if "
        "a folder, else the endpoint's model root, else .leyline/models/MODEL)",
    )
    p.add_argument(
        "--arms",
        default="baseline,stale-tool,stale-tool+failed-call,history-cutoff",
        help="comma list of arms (configs/runs/eval.yaml); each starts from an empty cache",
    )
    p.add_argument("--tasks", default="all", help="all or a comma list")
    p.add_argument(
        "--max-steps",
        type=int,
        default=None,
        help="most actions (LLM calls) per episode (default: the config's agent.max_steps, "
        "debug-gym's 50, which counts the reset as a step: 49 actions)",
    )
    p.add_argument("--runs", type=int, default=1, help="runs of every (task, arm)")
    p.add_argument(
        "--out",
        type=Path,
        default=Path("runs/mini-nightmare"),
        help="output folder (reruns resume)",
    )
    p.add_argument(
        "--config",
        type=Path,
        default=None,
        help="YAML over the defaults (configs/runs/eval.yaml; debug-gym's own config works)",
    )
    p.add_argument("--task-timeout", type=float, default=None, help="seconds per episode")
    p.add_argument("--max-tokens", type=int, default=None, help="generation length per step")
    p.add_argument(
        "--context-limit-k", type=int, default=None, help="context window, thousands of tokens"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_eval_mini_nightmare)

    p = sub.add_parser("demo", help="main job: mini model, quick mechanism benchmark, correctness")
    p.add_argument("--out", type=Path, default=Path("runs/demo"), help="output folder")
    p.add_argument(
        "--models-dir", type=Path, default=Path(".leyline/models"), help="where models are built"
    )
    p.add_argument("--arch", default="deepseek_v2", help="model architecture (make-model --arch)")
    p.add_argument("--size", default="mini", choices=["tiny", "mini"], help="model size")
    p.add_argument("--no-real-model", dest="real_model", action="store_false",
                   help="skip the real-model section (SmolLM2: quick quality report, a spliced chat)")  # fmt: skip
    p.set_defaults(func=_demo)

    tr = sub.add_parser("trajectories", help="agent trajectories").add_subparsers(
        dest="traj", metavar="WHAT"
    )
    p = tr.add_parser("generate", help="realistic debugging trajectories from mini_nightmare")
    p.add_argument(
        "--out", type=Path, default=Path("runs/trajectories.jsonl"), help="output JSONL file"
    )
    p.add_argument("--n", type=int, default=10, help="number of trajectories")
    p.add_argument("--seed", type=int, default=0, help="random seed")
    p.add_argument("--min-turns", type=int, default=10, help="fewest turns per trajectory")
    p.add_argument("--max-turns", type=int, default=40, help="most turns per trajectory")
    p.add_argument("--tasks", default="all", help="all or a comma list of mini_nightmare tasks")
    p.set_defaults(func=_trajectories_generate)


def _eval_mini_nightmare(args: argparse.Namespace) -> int:
    from .eval.eval_config import load_eval_config
    from .eval.eval_report import markdown
    from .eval.eval_run import run_eval

    over: dict = {}
    if args.task_timeout is not None:
        over["task_timeout_s"] = args.task_timeout
    if args.max_tokens is not None:
        over["generate"] = {"max_tokens": args.max_tokens}
    config = load_eval_config(args.config, **over)
    summary = run_eval(
        base_url=args.base_url,
        model=args.model,
        arms=args.arms,
        tasks=args.tasks,
        runs=args.runs,
        out=args.out,
        config=config,
        max_steps=args.max_steps,
        tokenizer=args.tokenizer,
        context_limit_k=args.context_limit_k,
        progress=not args.no_progress,
    )
    print(markdown(summary))
    print(
        f"episodes: {args.out / 'episodes.jsonl'}  summary: {args.out / 'summary.json'}  "
        f"plot: {args.out / 'summary.png'}"
    )
    return 0


def _bench_mechanism(args: argparse.Namespace) -> int:
    from .bench.mechanism import main as mechanism_main

    return mechanism_main(args)


def _bench_side_by_side(args: argparse.Namespace) -> int:
    from .bench.side_by_side import main as side_main

    return side_main(args)


def _bench_http(args: argparse.Namespace) -> int:
    from .bench.side_by_side import main_http

    return main_http(args)


def _module_main(module: str, whole: bool = False) -> Callable[[argparse.Namespace], int]:
    """The module's ``main``, given the parsed arguments (``whole``) or its own options."""

    def run(args: argparse.Namespace) -> int:
        main = importlib.import_module(f".{module}", __package__).main
        return int(main(args if whole else args.passthrough) or 0)

    return run


def _bench_report(args: argparse.Namespace) -> int:
    from .reports.results import write_results

    n = write_results(args.runs, args.to)
    print(f"{args.to}: {n} recorded run(s) from {args.runs}")
    return 0


def _bench_engine(args: argparse.Namespace) -> int:
    from .bench.bench_engine import main

    return main(args)


def _bench_serve(args: argparse.Namespace) -> int:
    from .bench.bench_serve import main

    return main(args)


def _check_correctness(args: argparse.Namespace) -> int:
    from .check.correctness import main as correctness_main

    return correctness_main(args)


def _demo(args: argparse.Namespace) -> int:
    from .reports.demo import main as demo_main

    return demo_main(args)


def _trajectories_generate(args: argparse.Namespace) -> int:
    from .replay.trajectories import main as trajectories_main

    return trajectories_main(args)
