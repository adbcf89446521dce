"""Benchmark (not a test): what a grammar costs per decoded token, constrained vs free, one run.

    python -m leyline_agent.experiments.bench.bench_grammar [--arch llama] [--size tiny]
        [--tokens 64] [--batches 1,4] [--repeats 3] [--threads 1]

One engine on a seeded random-weight model (``leyline make-model``'s checkpoints), one
cached prompt, three arms decoded side by side, interleaved, ``--repeats`` times each:

- ``free``: no grammar;
- ``json_schema``: ``response_format`` json_schema of an array of at least 64 small objects
  (so the grammar stays busy for every token: keys, numbers, strings, separators);
- ``tool_call``: ``tool_choice`` required over two tools (the server's structural tag).

A batch of ``b`` runs ``b`` requests of one arm at once (their steps batched by the
engine, one bitmask for all constrained rows). The figure is each request's decode time
after its first token over its tokens after the first (ms/token), the median over requests
and repeats; the ratio is against ``free`` at the same batch. ``--tokens`` is the answer's
``max_tokens``; an answer the grammar ends early counts what it wrote. Last, the mask alone:
``mask_logits`` (fill the bitmask, apply it) on ``[b, vocab]`` logits, microseconds per call.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from typing import Any

from ..options import standalone

__all__ = ["add_arguments", "main"]

ITEM = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "n": {"type": "integer"}},
    "required": ["name", "n"],
}
SCHEMA = {"type": "array", "items": ITEM, "minItems": 64}
TOOLS = [
    {"type": "function", "function": {"name": n, "parameters": {"type": "object", "properties": {a: {"type": "string"}}, "required": [a]}}}
    for n, a in (("read", "path"), ("bash", "command"))
]  # fmt: skip
PROMPT = [{"role": "user", "content": "list every file of the repository with its size"}]


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The flags (stdlib only)."""
    ap.add_argument("--arch", default="llama", help="a `leyline make-model` architecture")
    ap.add_argument("--size", default="tiny", help="tiny or mini")
    ap.add_argument("--tokens", type=int, default=64, help="max_tokens of each answer (>= 8)")
    ap.add_argument("--batches", default="1,4", help="requests decoded at once")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each arm per batch")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")


def _arms(engine: Any) -> dict[str, tuple[list[int], Any]]:
    """(prompt ids, grammar) of each arm."""
    from leyline_agent.engine import grammar_spec as gs
    from leyline_agent.server.tool_choice import ToolChoice

    plain = engine.render(PROMPT, add_generation_prompt=True)
    choice = ToolChoice("required")
    forced = engine.tokenizer.encode(choice.forced_prefix(), add_special_tokens=False)
    with_tools = engine.render(PROMPT, tools=TOOLS, add_generation_prompt=True) + forced
    return {
        "free": (plain, None),
        "json_schema": (plain, gs.json_schema(SCHEMA, "response_format")),
        "tool_call": (with_tools, choice.grammar(TOOLS)),
    }


def _decode(engine: Any, ids: list[int], grammar: Any, batch: int, tokens: int) -> list[float]:
    """ms/token after the first token of each of ``batch`` requests run at once."""
    from leyline_agent.engine.params import SamplingParams

    out: list[float] = []

    def one(seed: int) -> None:
        params = SamplingParams(max_tokens=tokens, temperature=1.0, seed=seed, grammar=grammar)
        r = engine.generate(ids, params)
        if len(r.output_ids) > 1:
            out.append(1000 * (r.e2e_s - r.ttft_s) / (len(r.output_ids) - 1))

    threads = [threading.Thread(target=one, args=(s,)) for s in range(batch)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def _mask_us(engine: Any, grammar: Any, rows: int, calls: int = 200) -> float:
    """Microseconds per ``mask_logits`` on ``[rows, vocab]`` logits, every row constrained."""
    import torch

    from leyline_agent.engine.grammar import Grammars, mask_logits

    grammars = Grammars(engine.tokenizer, engine.vocab_size, engine.stop_token_ids)
    constraints = [grammars.constraint(grammar, engine.stop_token_ids) for _ in range(rows)]
    logits = torch.zeros(rows, engine.vocab_size)
    mask_logits(logits, constraints)  # warm
    t = time.perf_counter()
    for _ in range(calls):
        mask_logits(logits, constraints)
    return 1e6 * (time.perf_counter() - t) / calls


def main(a: argparse.Namespace) -> int:
    import torch

    from leyline_agent.engine.checkpoints.store import model_dir
    from leyline_agent.engine.engine import Engine

    if a.tokens < 8:
        raise SystemExit("bench_grammar: --tokens: must be >= 8")
    torch.set_num_threads(a.threads)
    engine = Engine.from_pretrained(model_dir(a.arch, a.size))
    arms = _arms(engine)
    batches = [int(b) for b in a.batches.split(",") if b]
    for ids, grammar in arms.values():  # warm: prompts cached, grammars compiled
        _decode(engine, ids, grammar, 1, 8)
    ms: dict[tuple[str, int], list[float]] = {(k, b): [] for k in arms for b in batches}
    for _ in range(a.repeats):
        for b in batches:
            for name, (ids, grammar) in arms.items():  # interleaved: same machine load
                ms[name, b] += _decode(engine, ids, grammar, b, a.tokens)
    print(f"{a.arch}-{a.size}, vocab {engine.vocab_size}, {a.threads} torch thread(s), "
          f"max_tokens {a.tokens}, {a.repeats} repeats")  # fmt: skip
    print(f"{'arm':<12} {'batch':>5} {'ms/token':>9} {'vs free':>8} {'answers':>8}")
    for b in batches:
        free = statistics.median(ms["free", b])
        for name in arms:
            m = statistics.median(ms[name, b])
            print(f"{name:<12} {b:>5} {m:>9.2f} {m / free:>7.2f}x {len(ms[name, b]):>8}")
    print(f"{'mask alone':<12} {'rows':>5} {'us/call':>9}")
    for b in batches:
        for name in ("json_schema", "tool_call"):
            print(f"{name:<12} {b:>5} {_mask_us(engine, arms[name][1], b):>9.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(standalone(add_arguments, main))
