"""``front.pin_report`` on vLLM's attachment (``vllm_plugin.guard.VLLM``) without a server: which requests ask the EngineCore, and where
``usage.leyline.splice_evicted`` lands in a JSON answer and in a stream."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

from leyline_agent.front.pin_report import PinReport
from leyline_agent.namespaces import ANONYMOUS, Namespace
from leyline_agent.vllm_plugin.guard import VLLM
from leyline_agent.vllm_plugin.namespace import salt_for

A = salt_for(Namespace(session="A"))


class Route:
    def __init__(self, watched: set[str], lost: bool) -> None:
        self.watched, self.lost, self.asked = dict.fromkeys(watched), lost, []

    async def arrive(self, salt: str) -> bool:
        self.asked.append(salt)
        return self.lost


def _app(answer: list[bytes], ctype: bytes):
    async def app(scope: Any, receive: Any, send: Any) -> None:
        body = (await receive())["body"]
        assert json.loads(body)  # the request reaches vLLM whole
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", ctype), (b"content-length", b"0")]})  # fmt: skip
        for i, chunk in enumerate(answer):
            more = i < len(answer) - 1
            await send({"type": "http.response.body", "body": chunk, "more_body": more})

    return app


def _run(route: Route, body: dict[str, Any], answer: list[bytes], ctype=b"application/json"):
    sent: list[dict[str, Any]] = []
    scope = {"type": "http", "method": "POST", "path": "/v1/completions",
             "app": SimpleNamespace(state=SimpleNamespace(leyline=route))}  # fmt: skip
    raw = json.dumps(body).encode()

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": raw, "more_body": False}

    async def send(m: dict[str, Any]) -> None:
        sent.append(m)

    asyncio.run(PinReport(_app(answer, ctype), VLLM)(scope, receive, send))
    return b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body"), sent


def test_a_lost_result_is_said_in_a_json_answer_with_its_new_length():
    route = Route({A}, lost=True)
    out, sent = _run(
        route, {"prompt": [1], "cache_salt": A}, [b'{"usage":', b'{"total_tokens":3}}']
    )
    assert json.loads(out)["usage"] == {"total_tokens": 3, "leyline": {"splice_evicted": True}}
    assert dict(sent[0]["headers"])[b"content-length"] == str(len(out)).encode()
    assert route.asked == [A]


def test_in_a_stream_it_lands_in_the_usage_event_only():
    events = [b'data: {"choices":[{"text":"a"}],"usage":null}\n\ndata: {"cho',
              b'ices":[],"usage":{"total_tokens":3}}\n\ndata: [DONE]\n\n']  # fmt: skip
    out, _ = _run(Route({A}, True), {"cache_salt": A}, events, b"text/event-stream")
    parts = [p for p in out.split(b"\n\n") if p]
    assert json.loads(parts[0][6:]) == {"choices": [{"text": "a"}], "usage": None}
    assert json.loads(parts[1][6:])["usage"]["leyline"] == {"splice_evicted": True}
    assert parts[2] == b"data: [DONE]"


def test_nothing_to_report_or_not_watched_passes_the_answer_as_it_is():
    answer = [b'{"usage":{"total_tokens":3}}']
    out, _ = _run(Route({A}, lost=False), {"cache_salt": A}, answer)
    assert out == answer[0]
    route = Route({A}, lost=True)
    out, _ = _run(route, {"cache_salt": "theirs"}, answer)  # a client's own salt
    assert out == answer[0] and route.asked == []
    route = Route({salt_for(ANONYMOUS)}, lost=True)  # no salt: the anonymous namespace
    out, _ = _run(route, {"prompt": [1]}, answer)
    assert route.asked == [salt_for(ANONYMOUS)]
    assert json.loads(out)["usage"]["leyline"]["splice_evicted"] is True
