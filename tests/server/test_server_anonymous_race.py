"""Anonymous clients with the same opening, run at the same time, are never merged.

Eight clients send the same system and user message, then each runs its own tool loop (its
own call ids and tool outputs) and stubs its own old tool results in place, which
``--client-edits amortize`` turns into splices. Each concurrent run must answer exactly as
the same client's solo run on an empty server (logprobs within 1e-4): a client merged into
another's conversation loses its splices (an exact prefill answers differently) or is
handed rows of another history. At every turn the eight hold eight different server
conversations (each its own namespace of spliced rows, none serialized behind another's
session). Real server on loopback, real ``openai`` SDK, no wrapper.
"""

from __future__ import annotations

import threading

import httpx
import openai
import pytest

from leyline_agent.testing.server import serve_in_thread

pytestmark = pytest.mark.slow

CLIENTS = 8
TRIALS = 20
TURNS = 5
KEEP = 2
STUB = "[stale output elided]"
TOOLS = [{"type": "function", "function": {"name": "read_file", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}}}}}]  # fmt: skip


@pytest.fixture(scope="module")
def srv(model_dir):
    from leyline_agent.engine.engine import Engine
    from leyline_agent.server.app import create_app

    app = create_app(Engine.from_pretrained(model_dir), client_edits="amortize")
    with serve_in_thread(app) as s:
        yield s


def _stubbed(history: list[dict]) -> list[dict]:
    calls = [i for i, m in enumerate(history) if m["role"] == "assistant"]
    stale = set(calls[: max(0, len(calls) - KEEP)])
    return [
        {**m, "content": STUB} if m["role"] == "tool" and i - 1 in stale else m
        for i, m in enumerate(history)
    ]


def _run(client: openai.OpenAI, model: str, who: int) -> list[tuple[str, list[float], str]]:
    history = [
        {"role": "system", "content": "You are a careful agent."},
        {"role": "user", "content": "Inspect the files and report."},
    ]
    out = []
    for k in range(TURNS):
        r = client.chat.completions.create(
            model=model, messages=_stubbed(history), tools=TOOLS, max_tokens=4,
            temperature=0, logprobs=True,
        )  # fmt: skip
        choice = r.choices[0]
        lp = [t.logprob for t in choice.logprobs.content]
        out.append((choice.message.content or "", lp, r.model_extra["leyline"]["conversation"]))
        call = {"id": f"call_c{who}t{k}", "type": "function",
                "function": {"name": "read_file", "arguments": f'{{"path": "c{who}_{k}.py"}}'}}  # fmt: skip
        body = " ".join(f"client{who} line{k}_{j}={j * (who + 1)}" for j in range(30))
        history += [
            {"role": "assistant", "content": choice.message.content or "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": body},
        ]
    return out


def _flush(srv) -> None:
    assert httpx.post(f"{srv.url}/leyline/v1/flush", timeout=60).status_code == 200


def _close(a, b) -> bool:
    return all(
        ta == tb
        and len(la) == len(lb)
        and all(abs(x - y) <= 1e-4 for x, y in zip(la, lb, strict=True))
        for (ta, la, _), (tb, lb, _) in zip(a, b, strict=True)
    )


def test_concurrent_anonymous_clients_each_equal_their_solo_runs(srv, model_dir):
    client = openai.OpenAI(base_url=srv.base_url, api_key="-", max_retries=0, timeout=300)
    name = model_dir.name
    solo = {}
    for who in range(CLIENTS):
        _flush(srv)
        solo[who] = _run(client, name, who)
    splices = httpx.get(f"{srv.url}/leyline/v1/stats", timeout=60).json()["splices"]["amortize"]
    assert splices >= CLIENTS  # the solo runs splice: a merged run would not
    for trial in range(TRIALS):
        _flush(srv)
        got: dict[int, list] = {}
        barrier = threading.Barrier(CLIENTS)

        def one(who: int, barrier: threading.Barrier, got: dict) -> None:
            barrier.wait(30)
            got[who] = _run(client, name, who)

        threads = [threading.Thread(target=one, args=(w, barrier, got)) for w in range(CLIENTS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
        assert sorted(got) == list(range(CLIENTS)), trial
        wrong = [w for w in range(CLIENTS) if not _close(got[w], solo[w])]
        assert not wrong, (trial, wrong)
        for turn in range(TURNS):  # a conversation (and its spliced rows' namespace) each
            assert len({got[w][turn][2] for w in range(CLIENTS)}) == CLIENTS, (trial, turn)
