"""``LeylineTransport`` under the real ``openai`` client, against the stub server on loopback.

Every way of calling the SDK (``with_options``, ``copy``, ``with_raw_response``,
``with_streaming_response``, streamed, async) passes through the transport: the chat bodies
the stub received are the stale-tool-edited histories (computed here independently), the
edits of cached messages ride in the chat body's ``leyline.edits`` (no directive request),
the call names its session, and replies are observed (else the session would reset or
forward nothing). httpx2 clients (the OpenAI SDK's own library) pass through it as well.
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

pytestmark = pytest.mark.slow

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
            assert body["leyline"]["client_edits"] == "amortize"
        # what was sent is the stubbed history (independent computation), turn by turn
        for k, body in enumerate(bodies):
            raw = history[: 1 + 2 * k]
            assert body["messages"] == stubbed(raw)
        # from turn 3 on, one new stale tool result per turn, each riding in its chat body
        assert stub.directive_bodies() == []
        edits = [b["leyline"].get("edits") for b in bodies]
        assert [e is not None for e in edits] == [False, False, True, True, True]
        assert session.stats.forwarded_edits == 3 == session.stats.body_edits
        for k, body in enumerate(bodies):
            for e in edits[k] or ():
                assert e["content"] == "[stale output of bash elided]"
                assert body["messages"][e["index"]]["content"] == e["content"]
                assert bodies[k - 1]["messages"][e["index"]]["content"] != e["content"]


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
            history.append(
                {"role": "tool", "tool_call_id": tool_calls[0]["id"], "content": f"o{k} " * 40}
            )
        return history

    with StubServer(script(5)) as stub:
        t = LeylineTransport([{"name": "stale-tool", "keep": KEEP}])
        asyncio.run(run(t, stub))
        [session] = t.sessions
        assert session.stats.resets == 0
        assert session.stats.forwarded_edits == 2 == session.stats.body_edits
        assert stub.directive_bodies() == []
        assert sum(1 for b in stub.chat_bodies() if b["leyline"].get("edits")) == 2


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
            msg = message_of(
                client.chat.completions.create(model="m", messages=history, tools=TOOLS)
            )
            history += [
                msg,
                {"role": "tool", "tool_call_id": msg["tool_calls"][0]["id"], "content": f"x{k}"},
            ]
        bodies = stub.chat_bodies()
        assert all("leyline" not in b for b in bodies)
        assert bodies[-1]["messages"] == stubbed(history[:-2])
        assert stub.directive_bodies() == []


@pytest.mark.parametrize("wrapper", ["transport", "wrap_openai"])
def test_three_concurrent_conversations_on_one_client_get_their_own_sessions(wrapper):
    """Real ``leyline serve`` (scripted tiny engine): three threads run their own tool loop
    on one client (``LeylineTransport``, or ``wrap_openai``), no session ids; each
    conversation is found by content, gets its own session and its own spliced edits (riding
    in its chat requests), and nothing resets."""
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
            assert s.stats.forwarded_edits == per == s.stats.body_edits
            assert s.stats.runtime_calls == 0  # no directive requests: the edits rode along
            assert s.stats.server_fallbacks == 0
        assert stats(srv)["splices"]["amortize"] == 3 * per


@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
def test_httpx2_clients_go_through_the_transport(is_async):
    """The OpenAI SDK and pydantic-ai build httpx2 clients: their requests are forwarded by
    an httpx2 transport and observed like httpx's (streamed and not)."""
    import httpx2  # installed by scripts/setup.sh: fail, never skip

    async def loop(client, history):
        for k in range(4):
            kw = {"model": "m", "messages": history, "tools": TOOLS}
            if k % 2:
                stream = await client.chat.completions.create(**kw, stream=True)
                chunks = [ch async for ch in stream]
                call = next(tc for ch in chunks for tc in ch.choices[0].delta.tool_calls or ())
                fn = {"name": call.function.name, "arguments": call.function.arguments}
                msg = {"role": "assistant", "content": None, "tool_calls": [{"id": call.id, "type": "function", "function": fn}]}  # fmt: skip
            else:
                msg = message_of(await client.chat.completions.create(**kw))
            history += [msg, {"role": "tool", "tool_call_id": msg["tool_calls"][0]["id"], "content": f"out {k} " * 30}]  # fmt: skip

    with StubServer(script(5)) as stub:
        t = LeylineTransport([{"name": "stale-tool", "keep": KEEP}])
        history = [{"role": "user", "content": "go"}]
        if is_async:
            client = openai.AsyncOpenAI(base_url=stub.base_url, api_key="k", http_client=httpx2.AsyncClient(transport=t))  # fmt: skip
            asyncio.run(loop(client, history))
        else:
            client = openai.OpenAI(base_url=stub.base_url, api_key="k", http_client=httpx2.Client(transport=t))  # fmt: skip
            for k in range(4):
                msg = message_of(client.chat.completions.create(model="m", messages=history, tools=TOOLS, stream=False))  # fmt: skip
                history += [msg, {"role": "tool", "tool_call_id": msg["tool_calls"][0]["id"], "content": f"out {k} " * 30}]  # fmt: skip
        [session] = t.sessions
        assert session.stats.resets == 0 and session.stats.turns == 4
        bodies = stub.chat_bodies()
        assert bodies[-1]["messages"] == stubbed(history[:-2])
        assert all(h["x-leyline-session"] == session.session_id for h in stub.chat_headers())
        assert session.stats.body_edits == 2 == sum(1 for b in bodies if b["leyline"].get("edits"))
