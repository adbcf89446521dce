"""Benchmark (not a test): a multi-turn reasoning agent against one engine, three arms.

    leyline bench drift [--contexts 2000,16000] [--clients 1,4] [--engine leyline|vllm]
        [--head-drift] [--out runs/drift/results.json]    (--contexts "": the diff's cost only)

Each session is a reasoning agent: ``--user-turns`` user messages, each followed by
``--steps`` tool steps. A step sends the history, streams the reply (its text is echoed
back, the proof the server asks for), and attaches the step's thinking (a few hundred
tokens, as ``reasoning_content``), a tool call and the tool's output. The model is a
three-layer Qwen3 made by ``leyline make-model`` (random weights: its replies are noise, so
the thinking is scripted; the template decides what the prompt holds). Arms, each on its own
server (a child process: ``leyline serve``, or with ``--engine vllm`` ``vllm serve`` from
``.venv-vllm`` at ``--block-size``):

- ``plain``: the Qwen3-style template (``--template reasoning``: earlier turns' thinking
  dropped once a user message arrives) and a plain prefix cache, what every engine does
  (``--client-edits off``; vanilla ``vllm serve``, no plugin);
- ``drift``: the same template, its drift spliced (``--client-edits amortize``; ``vllm
  serve`` + the Leyline plugin, ``LEYLINE_CLIENT_EDITS=amortize``);
- ``kept``: ``--template reasoning_kept`` (thinking stays in the history, the workaround) on
  a plain prefix cache, as ``plain``.

Arms are interleaved: turn k of every arm runs before turn k+1 of any (C sessions of one arm
in flight together), so a change of the machine's load lands on all arms alike; on vLLM a
pause (``--settle-s``) separates two arms' steps (``_settle_s``). Per arm:
prefilled tokens (prompt - cached, plus the tokens a drift splice prefilled), TTFT p50/p90
(first streamed chunk with text) and e2e of the whole replay, and the TTFT p50 and prefilled
tokens of the requests right after a new user message (where the drift is). The thinking is scripted
(sent back by the client), so every arm prefills each step's thinking once, where a real
reasoning model decodes it: the table also gives the prefilled tokens without it (the same
count, taken from every arm). ``--head-drift`` adds a head line whose reasoning effort
alternates from one user turn to the next; ``--clock`` a first line with the current time, a
new one on every request (a date or time in the system prompt). JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from ..options import standalone

ARMS = {
    "plain": ("reasoning", "off"),
    "drift": ("reasoning", "amortize"),
    "kept": ("reasoning_kept", "off"),
}
# vLLM answers a request with tools (tool_choice "auto") only with a tool-call parser
TOOL_PARSER = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
TOOLS = [{"type": "function", "function": {"name": "run", "description": "run a command",
          "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}}]  # fmt: skip


def _words(seed: int, n_tokens: int) -> str:
    return " ".join(f"w{(seed * 7919 + k * 31) % 1000}" for k in range(max(1, n_tokens // 2)))


def script(session: int, context: int, user_turns: int, steps: int, think: int) -> list[list]:
    """Per user turn, per step: (thinking, tool output) texts; sized so that the last prompt
    holds about ``context`` tokens in the reasoning-kept arm."""
    per_step = max(50, (context // 2) // (user_turns * steps) - think)
    return [
        [
            (_words(session * 100 + u * 10 + s, think), _words(session + u + s, per_step))
            for s in range(steps)
        ]  # fmt: skip
        for u in range(user_turns)
    ]


def _stream(url: str, model: str, messages: list[dict], max_tokens: int) -> dict[str, Any]:
    """One streamed chat request. Sampled (temperature 1), so that sessions' replies differ as
    real ones do: a reply two sessions share proves neither holds it, and is not spliced."""
    import httpx

    body = {"model": model, "messages": messages, "tools": TOOLS, "max_tokens": max_tokens,
            "temperature": 1.0, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    t0 = time.perf_counter()
    ttft, text, usage, drift = None, "", None, None
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=900) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read().decode()[:500]}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            drift = drift or (chunk.get("leyline") or {}).get("drift")
            for c in chunk.get("choices") or []:
                delta = c.get("delta") or {}
                piece = (delta.get("content") or "") + (delta.get("reasoning_content") or "")
                if piece and ttft is None:
                    ttft = time.perf_counter() - t0
                text += delta.get("content") or ""
            usage = chunk.get("usage") or usage
    e2e = time.perf_counter() - t0
    return {"ttft": ttft if ttft is not None else e2e, "e2e": e2e, "text": text,
            "usage": usage or {}, "drift": drift}  # fmt: skip


def run_session(
    url: str, model: str, plan: list[list], max_tokens: int, system: str, head_drift: bool,
    name: str = "session",
    thinking_key: str = "reasoning_content",
    clock: bool = False,
) -> Any:
    """One session, turn by turn (a generator of per-request records, one step at a time).
    ``head_drift``: the system prompt's first line says a reasoning effort that alternates
    between high and low from one user turn to the next. ``clock``: the system prompt
    starts with the current time, a new one on every request (the date-line case).
    ``thinking_key``: the assistant message's field the server reads thinking from (vLLM
    0.32: ``reasoning``)."""
    history: list[dict] = [{"role": "system", "content": system}]
    effort = ""
    for u, steps in enumerate(plan):
        if head_drift:
            effort = f"Reasoning effort: {'high' if u % 2 == 0 else 'low'}\n"
        history.append({"role": "user", "content": f"Task {u} of {name}: fix the failing test."})
        for s, (think, output) in enumerate(steps):
            now = f"Current time: 2026-12-03 09:{u:02d}:{s * 7:02d}\n" if clock else ""
            history[0] = {"role": "system", "content": f"{now}{effort}{system}"}
            r = _stream(url, model, history, max_tokens)
            usage = r["usage"]
            drift = (usage.get("leyline") or {}).get("drift") or r["drift"] or {}
            prompt = usage.get("prompt_tokens", 0)
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            yield {"prompt": prompt, "cached": cached, "ttft": r["ttft"], "e2e": r["e2e"],
                   "boundary": u > 0 and s == 0,  # the first request after a new user message
                   "drift_prefilled": drift.get("prefilled_tokens", 0) if drift.get("spliced") else 0,
                   "drift_spliced": bool(drift.get("spliced")),
                   "drift_unspliced": drift.get("unspliced")}  # fmt: skip
            call_id = f"call_{u}_{s}_{len(history)}"
            history.append({"role": "assistant", "content": r["text"], thinking_key: think,
                            "tool_calls": [{"id": call_id, "type": "function", "function":
                                            {"name": "run", "arguments": json.dumps({"cmd": f"t{s}"})}}]})  # fmt: skip
            history.append({"role": "tool", "tool_call_id": call_id, "content": output})


def _step(gen: Any, out: list[dict], errors: list[BaseException]) -> None:
    try:
        out.append(next(gen))
    except BaseException as e:  # noqa: BLE001 - reported by the caller
        errors.append(e)


def _settle_s(args: argparse.Namespace) -> float:
    """Seconds between two arms' steps: on vLLM, ``QUIET_AFTER_REQUEST_S`` (a server just
    used keeps a core busy for about a second); ``leyline serve`` goes quiet at once (0)."""
    from leyline_agent.launch import QUIET_AFTER_REQUEST_S

    if args.settle_s is not None:
        return args.settle_s
    return QUIET_AFTER_REQUEST_S if args.engine == "vllm" else 0.0


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else 0.0


def _server(args: argparse.Namespace, arm: str, model: Path, context: int, env: Any) -> Any:
    """The arm's server, a context manager that yields ``(base URL, served model name)``."""
    from contextlib import contextmanager

    from leyline_agent.launch import serve_vllm

    from .bench_serve import leyline_serve

    edits = ARMS[arm][1]

    @contextmanager
    def serve() -> Any:
        if args.engine == "leyline":
            flags = ["--client-edits", edits, "--served-model-name", "m"]
            with leyline_serve(model, flags, env, None) as url:
                yield url, "m"
            return
        with serve_vllm(
            model,
            leyline=edits != "off",
            block_size=args.block_size,
            max_model_len=max(8192, context + 8192),  # the kept arm's prompts are longer
            startup_timeout_s=900.0,
            extra_args=["--enable-prefix-caching", *TOOL_PARSER],
            env={**(env or {}), "LEYLINE_CLIENT_EDITS": edits},
        ) as srv:
            yield srv.url, srv.model

    return serve()


def bench(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from leyline_agent.engine.checkpoints.modelgen import make_model
    from leyline_agent.engine.checkpoints.store import tiny_model_dir

    root = Path(tempfile.mkdtemp(prefix="bench-drift-"))
    tok = AutoTokenizer.from_pretrained(tiny_model_dir("qwen3"))
    models = {t: make_model("qwen3", "tiny", root / f"q3-{t}", seed=5, tokenizer=tok,
                            template=t, layers=3)
              for t in {"reasoning", "reasoning_kept"}}  # fmt: skip
    env = {"OMP_NUM_THREADS": str(args.torch_threads)} if args.torch_threads else None
    rows = []
    for context in args.contexts:
        for c in args.clients:
            servers, urls, names = {}, {}, {}
            try:
                for arm, (template, _) in ARMS.items():
                    servers[arm] = _server(args, arm, models[template], context, env)
                    urls[arm], names[arm] = servers[arm].__enter__()
                system = "You are a careful coding agent.\n" + _words(99, context // 4)
                plans = [script(k, context, args.user_turns, args.steps, args.think)
                         for k in range(c)]  # fmt: skip
                think_sent = sum(
                    len(tok.encode(f"<think>\n{think}\n</think>\n\n", add_special_tokens=False))
                    for p in plans for steps in p for think, _ in steps
                ) - sum(len(tok.encode(f"<think>\n{p[-1][-1][0]}\n</think>\n\n",
                                       add_special_tokens=False)) for p in plans)  # fmt: skip
                key = "reasoning" if args.engine == "vllm" else "reasoning_content"
                gens = {arm: [run_session(urls[arm], names[arm], p, args.max_tokens, system,
                                          args.head_drift, f"session {k}", key, args.clock)
                              for k, p in enumerate(plans)]
                        for arm in ARMS}  # fmt: skip
                recs: dict[str, list[dict]] = {arm: [] for arm in ARMS}
                wall = dict.fromkeys(ARMS, 0.0)
                settle = _settle_s(args)
                for _ in range(args.user_turns * args.steps):  # interleaved: step k of every arm
                    for arm in ARMS:
                        out: list[dict] = []
                        errors: list[BaseException] = []
                        t0 = time.perf_counter()
                        threads = [threading.Thread(target=_step, args=(g, out, errors))
                                   for g in gens[arm]]  # fmt: skip
                        for t in threads:
                            t.start()
                        for t in threads:
                            t.join()
                        if errors:  # a failed request fails the run: no row from a part
                            raise RuntimeError(f"arm {arm}: {errors[0]!r}") from errors[0]
                        wall[arm] += time.perf_counter() - t0
                        recs[arm] += out
                        time.sleep(settle)  # the server just used is quiet again
            finally:
                for s in servers.values():
                    s.__exit__(None, None, None)
            for arm in ARMS:
                r = recs[arm]
                prefilled = sum(x["prompt"] - x["cached"] + x["drift_prefilled"] for x in r)
                rows.append({"context": context, "clients": c, "arm": arm, "requests": len(r),
                             "prompt_tokens": sum(x["prompt"] for x in r),
                             "last_prompt_tokens": max(x["prompt"] for x in r),
                             "prefilled_tokens": prefilled,
                             "scripted_thinking_tokens": think_sent,
                             "prefilled_without_thinking": prefilled - think_sent,
                             "drift_splices": sum(x["drift_spliced"] for x in r),
                             "drift_unspliced": [x["drift_unspliced"] for x in r
                                                 if x["drift_unspliced"]],
                             "ttft_p50_s": statistics.median(x["ttft"] for x in r),
                             "ttft_p90_s": _pct([x["ttft"] for x in r], 0.9),
                             "boundary_ttft_p50_s": statistics.median(
                                 x["ttft"] for x in r if x["boundary"]),
                             "boundary_prefilled_tokens": sum(
                                 x["prompt"] - x["cached"] + x["drift_prefilled"]
                                 for x in r if x["boundary"]),
                             "e2e_s": wall[arm]})  # fmt: skip
            print_rows([x for x in rows if x["context"] == context and x["clients"] == c])
    return {"command": shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]]),
            "engine": args.engine, "block_size": args.block_size if args.engine == "vllm" else None,
            "head_drift": args.head_drift, "clock": args.clock, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "load_after": os.getloadavg(), "rows": rows}  # fmt: skip


def diff_cost(sizes: tuple[int, ...] = (2000, 16000, 100000), reps: int = 5) -> list[dict]:
    """Cost of ``directives.drift.drift_spans`` per request (best of ``reps``), printed: a
    head-line replacement, a 300-token think deletion and an empty-block insertion before a
    200-token new turn; a pure extension; and an unrelated prompt (the search gives up at its
    bound)."""
    import random

    from leyline_agent.directives.drift import drift_spans

    rng = random.Random(0)
    out = []
    for n in sizes:
        t = [rng.randrange(6000) for _ in range(n)]
        tail = [rng.randrange(6000) for _ in range(200)]
        drift = t[:5] + [1, 2] + t[7 : n // 3] + t[n // 3 + 300 : 2 * n // 3] + [3] * 6
        cases = {"drift (3 spans)": drift + t[2 * n // 3 :] + tail, "extension": t + tail,
                 "unrelated": [rng.randrange(6000) for _ in range(n)]}  # fmt: skip
        for name, new in cases.items():
            best = min(_timed(drift_spans, t, new) for _ in range(reps))
            out.append({"tokens": n, "case": name, "ms": best * 1e3})
            print(f"diff {n:>6} tokens, {name:<16}: {best * 1e3:7.2f} ms", flush=True)
    return out


def _timed(fn: Any, *args: Any) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def print_rows(rows: list[dict]) -> None:
    by = {r["arm"]: r for r in rows}
    for r in rows:
        plain, kept = by["plain"], by["kept"]
        print(f"ctx {r['context']:>6} C={r['clients']} {r['arm']:>5}: last prompt "
              f"{r['last_prompt_tokens']:>6}  prefilled {r['prefilled_tokens']:>7} "
              f"({r['prefilled_tokens'] / plain['prefilled_tokens']:.2f}x plain, "
              f"{r['prefilled_tokens'] / kept['prefilled_tokens']:.2f}x kept; without the "
              f"scripted thinking {r['prefilled_without_thinking']:>7}: "
              f"{r['prefilled_without_thinking'] / plain['prefilled_without_thinking']:.2f}x "
              f"plain, {r['prefilled_without_thinking'] / kept['prefilled_without_thinking']:.2f}x kept)  "
              f"TTFT p50 {r['ttft_p50_s'] * 1e3:7.1f} ms "
              f"({r['ttft_p50_s'] / plain['ttft_p50_s']:.2f}x plain)  p90 "
              f"{r['ttft_p90_s'] * 1e3:7.1f} ms  e2e {r['e2e_s']:6.1f} s  at new user "
              f"messages: TTFT p50 {r['boundary_ttft_p50_s'] * 1e3:7.1f} ms "
              f"({r['boundary_ttft_p50_s'] / plain['boundary_ttft_p50_s']:.2f}x plain), "
              f"prefilled {r['boundary_prefilled_tokens']} "
              f"({r['boundary_prefilled_tokens'] / plain['boundary_prefilled_tokens']:.2f}x)  "
              f"splices {r['drift_splices']} unspliced {r['drift_unspliced']}", flush=True)  # fmt: skip


def main(args: argparse.Namespace) -> int:
    """Run and write ``--out`` (``leyline bench drift`` records the printed table)."""
    costs = diff_cost()
    report = {**bench(args), "diff_cost": costs} if args.contexts else {"diff_cost": costs}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")
    return 0


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    ap.add_argument("--contexts", type=ints, default=[2000, 16000],
                    help='comma list of context lengths ("": the diff\'s cost only)')  # fmt: skip
    ap.add_argument("--clients", type=ints, default=[1, 4], help="comma list of sessions in flight")
    ap.add_argument("--user-turns", type=int, default=3, help="user messages per session")
    ap.add_argument("--steps", type=int, default=3, help="tool steps per user message")
    ap.add_argument("--think", type=int, default=300, help="thinking tokens per step")
    ap.add_argument("--max-tokens", type=int, default=8, help="tokens generated per request")
    ap.add_argument("--torch-threads", type=int, default=None, help="the servers' OMP_NUM_THREADS")
    ap.add_argument("--head-drift", action="store_true", help="an effort line that alternates")
    ap.add_argument("--clock", action="store_true", help="a time line, new on every request")
    ap.add_argument("--engine", choices=("leyline", "vllm"), default="leyline", help="the servers")
    ap.add_argument("--block-size", type=int, default=128, help="vLLM's (--engine vllm)")
    ap.add_argument("--settle-s", type=float, default=None,
                    help="pause between two arms' steps (default: 1.5 s on vLLM, 0 on leyline)")
    ap.add_argument("--out", default="runs/drift/results.json", help="the results JSON")


if __name__ == "__main__":
    raise SystemExit(standalone(add_arguments, main))
