"""The demo's real-model section: SmolLM2 (``leyline fetch-model smollm2``) on ``leyline serve``.

1. the quality report in its quick form (``quality.QUICK``: 8 agent conversations and 6 fact
   cases, stale output stubbed, fp32, every arm of ``quality_arms.ARMS`` through the HTTP
   API, the cache flushed once per case: FULL's prefill is the splices' base and FORGET
   reuses its rows before the edit);
2. one agent chat answered through a splice: an OpenAI-style tool conversation is asked a
   question, then sent again with its stale tool output stubbed and a new question; the
   server splices the edit into the cached conversation (``usage.leyline`` says so).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx

__all__ = ["real_model_section"]

_SHELL = {"type": "function", "function": {
    "name": "shell", "description": "Run a shell command in the repository",
    "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]},
}}  # fmt: skip


def _tool_chat(conv: dict[str, Any], steps: int = 3) -> tuple[list[dict[str, Any]], int]:
    """The conversation's first ``steps`` commands as OpenAI tool calls and results; the index
    of the first result (the one that goes stale)."""
    msgs, stale, n = conv["messages"][:2], -1, 0
    for m in conv["messages"][2:]:
        if m["role"] == "assistant" and "`" in m["content"] and n < steps:
            cmd = m["content"].rsplit("`", 2)[1]
            msgs.append({"role": "assistant", "content": None, "tool_calls": [{
                "id": f"call_{n}", "type": "function",
                "function": {"name": "shell", "arguments": json.dumps({"cmd": cmd})}}]})  # fmt: skip
        elif m["role"] == "tool" and n < steps:
            msgs.append({"role": "tool", "tool_call_id": f"call_{n}", "content": m["content"]})
            stale = len(msgs) - 1 if stale < 0 else stale
            n += 1
    return msgs, stale


def _chat(url: str, model: str, msgs: list[dict[str, Any]]) -> dict[str, Any]:
    body = {"model": model, "messages": msgs, "tools": [_SHELL], "temperature": 0, "max_tokens": 40}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600)
    r.raise_for_status()
    return r.json()


def _splice_chat(url: str, model: str) -> list[str]:
    from ..check.quality_data import load_conversations

    conv = next(c for c in load_conversations() if c["id"] == "general-02")
    msgs, k = _tool_chat(conv)
    first = msgs + [{"role": "user", "content": "Which test fails, and why?"}]
    a1 = _chat(url, model, first)["choices"][0]["message"]
    stub = "[output removed as stale; run the command again to see it]"
    edited = [*first[:k], {**first[k], "content": stub}, *first[k + 1 :]]
    q2 = "What should we change in ledger/accounts.py to fix it?"
    j = _chat(url, model, [*edited, {"role": "assistant", "content": a1.get("content") or ""},
                           {"role": "user", "content": q2}])  # fmt: skip
    usage = j.get("usage") or {}
    lm = usage.get("leyline") or {}
    return [
        f"one chat through a splice ({len(msgs)} messages of real tool output, the first result stubbed):",
        f"  Q1: {first[-1]['content']}",
        f"  A1: {(a1.get('content') or '').strip()}",
        f"  Q2 (stale output stubbed): {q2}",
        f"  A2: {(j['choices'][0]['message'].get('content') or '').strip()}",
        f"  prompt {usage.get('prompt_tokens')} tokens, cached "
        f"{(usage.get('prompt_tokens_details') or {}).get('cached_tokens')}, "
        f"splices {lm.get('splices')}",
    ]


def real_model_section(out: Path) -> list[str]:
    """Fetch SmolLM2 (first use), serve it, run the quick quality report and the chat."""
    from transformers import AutoTokenizer

    from leyline_agent.engine.checkpoints.fetch import smollm2_dir

    from ..bench.side_by_side import leyline_serve
    from ..check.quality import build_cases, quick_caption, report, run_arms, select_conversations
    from ..check.quality_arms import ARMS, QualityServer
    from ..check.quality_data import load_conversations

    print("real model: SmolLM2-135M-Instruct (leyline fetch-model smollm2) ...", flush=True)
    model = smollm2_dir()
    tok = AutoTokenizer.from_pretrained(model)
    cases = build_cases(tok, select_conversations(load_conversations(), quick=True), ["stub"])
    arms = list(ARMS.values())
    out.mkdir(parents=True, exist_ok=True)
    with leyline_serve(model) as url:
        server = QualityServer(url, model.name)
        try:
            results = run_arms(server, arms, cases, tok, 8, log=out / "cases-float32.jsonl",
                               share_prefix=True)  # fmt: skip
        finally:
            server.close()
        lines = [f"Real model: {model}", f"Quality ({quick_caption()}; greedy answers: 8 tokens;",
                 "full set: leyline check quality, docs/results.md):",
                 *report(results, [a.name for a in arms], "float32"), ""]  # fmt: skip
        lines += _splice_chat(url, model.name)
    return lines
