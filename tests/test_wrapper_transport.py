"""``LeylineTransport`` under the real ``openai`` client, against the stub server on loopback.

Every way of calling the SDK (``with_options``, ``copy``, ``with_raw_response``,
``with_streaming_response``, streamed, async) passes through the transport: the chat bodies
the stub received are the stale-tool-edited histories (computed here independently), the
edits of cached messages arrive as directives naming the call's session, and replies are
observed (else the session would reset or forward nothing).
"""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from leyline_agent.agent.transport import LeylineTransport
from leyline_agent.errors import LeylineError
from leyline_agent.testing.scripted import ScriptedModel, text_turn, tool_turn
from leyline_agent.testing.stub_server import StubServer

TOOLS = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object", "properties": {}}}}]  # fmt: skip
KEEP = 1


def script(n: int) -> ScriptedModel:
    return ScriptedModel(
        [tool_turn("bash", {"cmd": f"step {k}"}, content=f"Step {k}.") for k in range(n)]
        + [text_turn("done")]
    )


def stubbed(raw: list[dict], keep: int = KEEP) -> list[dict]:
    turns = [m for m in raw if m["role"] == "assistant" and m.get("tool_calls")]
    old = {tc["id"] for m in turns[: max(0, len(turns) - keep)] for tc in m["tool_calls"]}
    return [
        {**m, "content": "[stale output of bash elided]"}
        if m["role"] == "tool" and m["tool_call_id"] in old
        else m
        for m in raw
    ]


def message_of(call_result) -> dict:
    """The assistant message of a create() result of any SDK flavour."""
    return call_result.choices[0].message.model_dump(exclude_none=True)


def _calls(client):
    """Five ways to call chat.completions.create; each yields the assistant message dict."""

    def plain(**kw):
        return message_of(client.chat.completions.create(**kw))

    def options(**kw):
        return message_of(client.with_options(timeout=30).chat.completions.create(**kw))

    def copied(**kw):
        return message_of(client.copy(max_retries=0).chat.completions.create(**kw))

    def raw(**kw):
        resp = client.chat.completions.with_raw_response.create(**kw)
        return message_of(resp.parse())

    def streaming(**kw):
        with client.chat.completions.with_streaming_response.create(**kw) as resp:
            return json.loads(resp.read())["choices"][0]["message"]

    return [plain, options, copied, raw, streaming]


def test_every_sdk_path_goes_through_the_transport():
    with StubServer(script(5)) as stub:
        t = LeylineTransport([{"name": "stale-tool", "keep": KEEP}])
        client = openai.OpenAI(
            base_url=stub.base_url, api_key="k", http_client=httpx.Client(transport=t)
        )
        history = [{"role": "user", "content": "go"}]
        for k, call in enumerate(_calls(client)):
            msg = call(model="m", messages=history, tools=TOOLS)
            history.append(msg)
            if msg.get("tool_calls"):
                history.append(
                    {"role": "tool", "tool_call_id": msg["tool_calls"][0]["id"], "content": f"out {k} " * 30}
                )  # fmt: skip
        bodies = stub.chat_bodies()
        assert len(bodies) == 5
        [session] = t.sessions  # one conversation, found by content on every call
        assert session.stats.resets == 0 and session.stats.turns == 5
        for body, headers in zip(bodies, stub.chat_headers(), strict=True):
            assert headers["x-leyline-session"] == session.session_id
            assert body["leyline"] == {"client_edits": "off"}
        # what was sent is the stubbed history (independent computation), turn by turn
        for k, body in enumerate(bodies):
            raw = history[: 1 + 2 * k]
            assert body["messages"] == stubbed(raw)
        # from turn 3 on, one new stale tool result per turn, each forwarded as a directive
        dirs = stub.directive_bodies()
        assert len(dirs) == 3 == session.stats.forwarded_edits
        assert all(d["session"] == session.session_id for d in dirs)
        for d in dirs:
            changed = [b for a, b in zip(d["old_messages"], d["new_messages"], strict=True) if a != b]
            assert [m["content"] for m in changed] == ["[stale output of bash elided]"]


def test_streamed_and_async_share_one_transport():
    async def run(t, stub):
        client = openai.AsyncOpenAI(
            base_url=stub.base_url, api_key="k", http_client=httpx.AsyncClient(transport=t)
        )
        history = [{"role": "user", "content": "go"}]
        for k in range(4):
            stream = await client.chat.completions.create(
                model="m", messages=history, tools=TOOLS, stream=True
            )
            content, calls = "", {}
            async for ch in stream:
                d = ch.choices[0].delta
                content += d.content or ""
                for tc in d.tool_calls or ():
                    c = calls.setdefault(tc.index, {"id": tc.id, "name": "", "arguments": ""})
                    c["name"] += tc.function.name or ""
                    c["arguments"] += tc.function.arguments or ""
            tool_calls = [{"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls.values()]  # fmt: skip
            history.append({"role": "assistant", "content": content, "tool_calls": tool_calls})
            history.append({"role": "tool", "tool_call_id": tool_calls[0]["id"], "content": f"o{k} " * 40})
        return history

    with StubServer(script(5)) as stub:
        t = LeylineTransport([{"name": "stale-tool", "keep": KEEP}])
        asyncio.run(run(t, stub))
        [session] = t.sessions
        assert session.stats.resets == 0
        assert session.stats.forwarded_edits == 2 == len(stub.directive_bodies())


def test_named_sessions_and_contradictions():
    with StubServer(script(3)) as stub:
        t = LeylineTransport(["stale-tool"])
        client = openai.OpenAI(
            base_url=stub.base_url, api_key="k", http_client=httpx.Client(transport=t),
            default_headers={"X-Leyline-Session": "mine"},
        )  # fmt: skip
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "a"}])
        assert [s.session_id for s in t.sessions] == ["mine"]
        assert stub.chat_headers()[-1]["x-leyline-session"] == "mine"
        with pytest.raises(LeylineError, match="contradicts"):
            client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "a"}],
                extra_body={"leyline_session": "other"},
            )  # fmt: skip
        assert len(stub.chat_bodies()) == 1  # refused before sending


def test_plain_endpoint_gets_no_directives_and_no_leyline_field():
    with StubServer(script(4), leyline_routes=False) as stub:
        t = LeylineTransport([{"name": "stale-tool", "keep": KEEP}])
        client = openai.OpenAI(base_url=stub.base_url, api_key="k", http_client=httpx.Client(transport=t))  # fmt: skip
        history = [{"role": "user", "content": "go"}]
        for k in range(4):
            msg = message_of(client.chat.completions.create(model="m", messages=history, tools=TOOLS))
            history += [msg, {"role": "tool", "tool_call_id": msg["tool_calls"][0]["id"], "content": f"x{k}"}]
        bodies = stub.chat_bodies()
        assert all("leyline" not in b for b in bodies)
        assert bodies[-1]["messages"] == stubbed(history[:-2])
        assert stub.directive_bodies() == []


@pytest.mark.parametrize("wrapper", ["transport", "wrap_openai"])
def test_three_concurrent_conversations_on_one_client_get_their_own_sessions(wrapper):
    """Real ``leyline serve`` (scripted tiny engine): three threads run their own tool loop
    on one client (``LeylineTransport``, or ``wrap_openai``), no session ids; each
    conversation is found by content, gets its own session and its own directives, and
    nothing resets."""
    import threading

    from leyline_agent.testing.frameworks import scripted_server, stats
    from leyline_agent.testing.scripted_engine import tool_call

    turns = 5
    script = [tool_call("bash", {"cmd": f"step {k}"}) for k in range(turns)]
    with scripted_server(script, client_edits="off") as (srv, engine):
        policies = [{"name": "stale-tool", "keep": KEEP}]
        if wrapper == "transport":
            t = LeylineTransport(policies)
            client = openai.OpenAI(base_url=srv.base_url, api_key="none", max_retries=0, http_client=httpx.Client(transport=t))  # fmt: skip
            sessions_of = lambda: t.sessions  # noqa: E731
        else:
            from leyline_agent import wrap_openai

            client = wrap_openai(openai.OpenAI(base_url=srv.base_url, api_key="none", max_retries=0), policies)  # fmt: skip
            sessions_of = lambda: list(client.leyline.sessions.values())  # noqa: E731
        barrier = threading.Barrier(3)
        errors: list[BaseException] = []

        def run(c: int) -> None:
            try:
                history = [{"role": "system", "content": "You run commands."}, {"role": "user", "content": f"task {c}"}]  # fmt: skip
                for k in range(turns):
                    barrier.wait(timeout=60)  # the three calls of a turn overlap
                    msg = message_of(client.chat.completions.create(model=engine.model_name, messages=history, tools=TOOLS, max_tokens=8))  # fmt: skip
                    history += [msg, {"role": "tool", "tool_call_id": msg["tool_calls"][0]["id"], "content": f"task {c} out {k} " * 20}]  # fmt: skip
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)
                barrier.abort()

        threads = [threading.Thread(target=run, args=(c,)) for c in range(3)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(120)
        assert not errors, errors
        sessions = sessions_of()
        assert len(sessions) == 3
        per = turns - 1 - KEEP  # stale results per conversation: turns 2..4 each stub one
        for s in sessions:
            assert s.stats.turns == turns and s.stats.resets == 0, s.stats
            assert s.stats.forwarded_edits == per == s.stats.runtime_calls
            assert s.stats.server_fallbacks == 0
        assert stats(srv)["splices"]["amortize"] == 3 * per
