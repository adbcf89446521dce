"""CLI verbs of the experiments layer, registered from one table (``VERBS``).

    leyline bench WHAT           benchmarks (bench/): mechanism, side-by-side, http, engine,
                                 serve, splice, soak, soak-hostile, store-budget, drift,
                                 splice-stream, directive, no-cost, grammar; report (reports/)
    leyline check WHAT           correctness, quality, bf16, gpu (check/)
    leyline eval mini-nightmare  debug-gym's froggy through Leyline, per arm (eval/)
    leyline demo                 mini model + quick mechanism benchmark + correctness report
    leyline trajectories generate  realistic agent trajectories from the mini_nightmare tasks

Each verb is one module with ``add_arguments(parser)`` and ``main(args) -> int``. A verb under
a group imports its module only when it is the verb being parsed (or asked for ``-h``), so
``leyline --help`` imports no benchmark; a verb with a ``record`` folder writes its printed
output to ``<--out or record>/report.json`` when it succeeds (``leyline bench report``).
"""

from __future__ import annotations

import argparse
import importlib
import weakref
from dataclasses import dataclass
from pathlib import Path

from .reports.results import recorded


@dataclass(frozen=True)
class Verb:
    """``leyline <words>``: ``module`` (under ``experiments/``) holds its options and its run."""

    words: tuple[str, ...]
    module: str
    help: str
    record: str | None = None  # runs/ folder: the run is recorded


GROUPS = {
    "bench": "benchmarks",
    "check": "correctness reports",
    "eval": "agent evaluations",
    "trajectories": "agent trajectories",
}

VERBS: tuple[Verb, ...] = (
    Verb(("bench", "mechanism"), "bench.mechanism",
         "replay hit rate and latency of splice vs prefix cache", "runs/mechanism"),
    Verb(("bench", "side-by-side"), "bench.side_by_side",
         "HTTP replay: vanilla vLLM, vLLM + Leyline, leyline serve", "runs/side-by-side"),
    Verb(("bench", "http"), "bench.http_endpoint",
         "HTTP replay against any OpenAI-compatible endpoint", "runs/http"),
    Verb(("bench", "engine"), "bench.bench_engine",
         "engine vs transformers generate: decode/prefill by context, concurrency", "runs/engine"),
    Verb(("bench", "serve"), "bench.bench_serve",
         "leyline serve: aggregate tok/s of C streaming clients", "runs/serve"),
    Verb(("bench", "splice"), "bench.bench_splice",
         "splice vs FORGET vs a forward, in-process (mini models)", "runs/splice"),
    Verb(("bench", "soak"), "bench.soak_rss",
         "RSS of leyline serve over rounds of streaming clients", "runs/soak"),
    Verb(("bench", "soak-hostile"), "bench.soak_hostile",
         "normal clients' latency beside hostile ones, 5xx, RSS", "runs/soak-hostile"),
    Verb(("bench", "store-budget"), "bench.store_budget",
         "Responses store: RSS under 1 MB inputs, stats, flush", "runs/store-budget"),
    Verb(("bench", "drift"), "bench.bench_drift",
         "reasoning-agent replay: plain cache, drift splices, kept", "runs/drift"),
    Verb(("bench", "splice-stream"), "bench.bench_splice_stream",
         "a stream's gaps while another session splices", "runs/splice-stream"),
    Verb(("bench", "directive"), "bench.bench_directive",
         "one directive's cost over HTTP, on every server", "runs/directive"),
    Verb(("bench", "no-cost"), "bench.bench_no_cost",
         "vLLM + plugin vs vanilla vLLM: TTFT without directives", "runs/no-cost"),
    Verb(("bench", "report"), "reports.results",
         "render every runs/**/report.json into docs/results.md"),
    Verb(("bench", "grammar"), "bench.bench_grammar",
         "constrained decoding: ms/token with and without a grammar", "runs/grammar"),
    Verb(("check", "gpu"), "check.gpu_check",
         "the prepared GPU check (scripts/gpu_check.sh runs it)"),
    Verb(("check", "correctness"), "check.correctness",
         "splice vs full context: argmax agreement, bf16 drift", "runs/correctness"),
    Verb(("check", "quality"), "check.quality",
         "real model: FULL vs FORGET vs a splice on agent conversations", "runs/quality"),
    Verb(("check", "bf16"), "check.bf16_facts",
         "real model: bf16 logits error, key drift, cache-state dependence", "runs/bf16"),
    Verb(("eval", "mini-nightmare"), "eval.eval_run",
         "debug-gym mini_nightmare, froggy through Leyline"),
    Verb(("demo",), "reports.demo",
         "main job: mini model, quick mechanism benchmark, correctness"),
    Verb(("trajectories", "generate"), "replay.trajectories",
         "realistic debugging trajectories from mini_nightmare"),
)  # fmt: skip

_PENDING: weakref.WeakKeyDictionary[argparse.ArgumentParser, Verb] = weakref.WeakKeyDictionary()


class _Verbs(argparse._SubParsersAction):
    """A group's verbs: the chosen one gets its module's options just before it parses."""

    def __call__(self, parser, namespace, values, option_string=None):  # type: ignore[no-untyped-def]
        chosen = self.choices.get(values[0]) if values else None
        if chosen is not None:
            load(chosen)
        super().__call__(parser, namespace, values, option_string)


def load(parser: argparse.ArgumentParser) -> None:
    """Give a verb's parser its module's options and run (once; other parsers: nothing)."""
    verb = _PENDING.pop(parser, None)
    if verb is None:
        return
    module = importlib.import_module(f"{__package__}.{verb.module}")
    module.add_arguments(parser)
    run = module.main
    if verb.record is not None:
        run = recorded(" ".join(verb.words), module.main, Path(verb.record))
    parser.set_defaults(func=run)


def register(sub: argparse._SubParsersAction) -> None:
    """Add this layer's verbs to the ``leyline`` parser."""
    groups: dict[str, argparse._SubParsersAction] = {}
    for verb in VERBS:
        *group, name = verb.words
        if not group:  # a top-level verb: filled now (its module imports light)
            parser = sub.add_parser(name, help=verb.help, description=verb.help)
            _PENDING[parser] = verb
            load(parser)
            continue
        if group[0] not in groups:
            g = sub.add_parser(group[0], help=GROUPS[group[0]])
            g.register("action", "parsers", _Verbs)
            groups[group[0]] = g.add_subparsers(dest=group[0], metavar="WHAT")
        _PENDING[groups[group[0]].add_parser(name, help=verb.help, description=verb.help)] = verb
