"""Scripted Anthropic Messages loops for the ``context_management`` tests of both servers.

``think_loop(send, salt, turns)``: a conversation whose assistant turns each open with a
long ``thinking`` block (the chat templates render it as a ``<think>`` span, what
``clear_thinking_20251015`` clears), then the model's own text; ``send(messages)`` posts one
turn through the ``anthropic`` SDK and returns its Message. Per turn: ``(message, prefilled
tokens)``, the prompt's uncached part plus what its splices prefilled (``prefilled``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["prefilled", "think_loop"]


def prefilled(m: Any) -> int:
    """The tokens a turn prefilled: its uncached prompt and what its splices prefilled."""
    spliced = sum(d.get("prefilled_tokens", 0) for d in m.model_extra["leyline"]["directives"])
    return int(m.usage.input_tokens) + spliced


def think_loop(
    send: Callable[[list[dict[str, Any]]], Any], salt: str, turns: int = 6
) -> list[tuple[Any, int]]:
    msgs: list[dict[str, Any]] = [{"role": "user", "content": f"Plan the work {salt}."}]
    out = []
    for k in range(turns):
        m = send(msgs)
        out.append((m, prefilled(m)))
        text = "".join(b.text for b in m.content if b.type == "text")
        think = " ".join(f"{salt}step{k}_{j} weighs option {j * k}" for j in range(20))
        msgs = [*msgs, {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": think, "signature": ""},
                    {"type": "text", "text": text or "ok"}]},
                {"role": "user", "content": f"Go on {k}."}]  # fmt: skip
    return out
