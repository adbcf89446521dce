"""wrap_openai with the real ``openai`` client against the stub server on loopback.

Checks what reaches the chat endpoint (the edited history) and which edits ride in its
``leyline.edits`` body field (only newly made edits of messages the server has cached, and
no separate ``/leyline/v1/directives`` request), sync and async, streamed and not, for a
Leyline endpoint and a plain one; a ``Runtime`` given explicitly gets directives.
"""

from __future__ import annotations

import asyncio
import copy
import json

import openai
import pytest

from leyline_agent.agent.http_runtime import HTTPRuntime
from leyline_agent.agent.wrappers import wrap_openai
from leyline_agent.errors import LeylineError, TrajectoryError
from leyline_agent.policies import StaleToolTruncation
from leyline_agent.testing.frameworks import stale_tool_results
from leyline_agent.testing.scripted import ScriptedModel, text_turn, tool_turn
from leyline_agent.testing.stub_server import StubServer

pytestmark = pytest.mark.slow

TOOLS = [
    {
        "type": "function",
        "function": {"name": "bash", "parameters": {"type": "object", "properties": {}}},
    }
]


def script(n: int = 6) -> ScriptedModel:
    return ScriptedModel(
        [tool_turn("bash", {"cmd": f"step {k}"}, content=f"Step {k}.") for k in range(n)]
        + [text_turn("All done.")]
    )


def expected_send(raw: list[dict], keep: int) -> list[dict]:
    """Independently of the policy: raw with all but the last ``keep`` tool turns stubbed."""
    return stale_tool_results(raw, keep)


def assemble(chunks) -> dict:
    """Rebuild the assistant message from stream chunks (independently of the wrapper)."""
    content, calls = "", {}
    for ch in chunks:
        d = ch.choices[0].delta
        content += d.content or ""
        for tc in d.tool_calls or ():
            c = calls.setdefault(
                tc.index,
                {"id": None, "type": "function", "function": {"name": "", "arguments": ""}},
            )
            c["id"] = tc.id or c["id"]
            c["function"]["name"] += (tc.function.name or "") if tc.function else ""
            c["function"]["arguments"] += (tc.function.arguments or "") if tc.function else ""
    msg = {"role": "assistant", "content": content or None}
    if calls:
        msg["tool_calls"] = [calls[k] for k in sorted(calls)]
    return msg


def reply_of(response) -> dict:
    return response.choices[0].message.model_dump(exclude_none=True)  # what agents append


def run_tools(raw: list[dict], reply: dict) -> None:
    raw.append(reply)
    for tc in reply.get("tool_calls") or ():
        cmd = json.loads(tc["function"]["arguments"])["cmd"]
        raw.append(
            {
                "role": "tool",
                "tool_call_id": tc["id"],
                "content": f"$ {cmd}\n" + "output line\n" * 25,
            }
        )


def sync_loop(client, turns: int, stream_every: int = 0, **extra) -> list[list[dict]]:
    raw = [{"role": "system", "content": "You fix bugs."}, {"role": "user", "content": "Fix it."}]
    history = []
    for k in range(turns):
        history.append(copy.deepcopy(raw))
        stream = bool(stream_every) and k % stream_every == 0
        resp = client.chat.completions.create(
            model="scripted", messages=raw, tools=TOOLS, stream=stream, **extra
        )
        run_tools(raw, assemble(resp) if stream else reply_of(resp))
    return history


def with_edits(server: StubServer) -> list[tuple[dict[str, str], dict]]:
    """(headers, body) of each chat call that carried edits in its ``leyline`` field."""
    pairs = zip(server.chat_headers(), server.chat_bodies(), strict=True)
    return [(h, b) for h, b in pairs if (b.get("leyline") or {}).get("edits")]


def patched(messages: list[dict], edits: list[dict]) -> list[dict]:
    """``messages`` with body edits applied, computed here (content / tool_calls replaced)."""
    out = copy.deepcopy(messages)
    for e in edits:
        out[e["index"]].update({k: e[k] for k in ("content", "tool_calls") if k in e})
    return out


def check_session_headers(server: StubServer, session: str) -> None:
    """Every chat call names ``session``; no directive request is sent (edits ride along)."""
    chats = server.chat_headers()
    assert chats and all(h.get("x-leyline-session") == session for h in chats)
    assert server.directive_bodies() == []


def check_diffing(
    server: StubServer, history: list[list[dict]], keep: int, session: str | None = None
) -> None:
    chats = server.chat_bodies()
    assert len(chats) == len(history)
    if session is not None:
        check_session_headers(server, session)
    for body, raw in zip(chats, history, strict=True):
        assert body["messages"] == expected_send(raw, keep)  # the edited history went out
        assert "leyline_session" not in body
    forwarded = 0
    for k in range(1, len(chats)):
        prev, cur = chats[k - 1]["messages"], chats[k]["messages"]
        reply = history[k][len(prev)]
        old = [
            *prev,
            {
                "role": "assistant",
                "content": reply.get("content") or None,
                "tool_calls": reply["tool_calls"],
            },
        ]
        changed = [i for i, (a, b) in enumerate(zip(old, cur, strict=False)) if a != b]
        field = chats[k]["leyline"]
        assert field["client_edits"] == "amortize"
        if not changed:
            assert "edits" not in field
            continue
        forwarded += 1
        assert sorted(e["index"] for e in field["edits"]) == changed
        assert patched(old, field["edits"]) == cur[: len(old)]
    assert forwarded == len(with_edits(server)) > 0
    assert server.directive_bodies() == []  # no separate directive request


@pytest.mark.parametrize("stream_every", [0, 2, 1], ids=["json", "mixed", "stream"])
def test_sync_client_sends_edited_history_and_forwards_new_edits(stream_every):
    with StubServer(script()) as server:
        base = openai.OpenAI(base_url=server.base_url, api_key="stub", max_retries=0)
        client = wrap_openai(base, policies=[StaleToolTruncation(keep=2)], session_id="agent-1")
        assert type(client) is type(base) and client is not base
        history = sync_loop(client, 7, stream_every=stream_every)
        check_diffing(server, history, keep=2, session="agent-1")
        assert server.bodies("/leyline/v1/stats") == [None]  # endpoint detected once
        stats = client.leyline.session("agent-1").stats
        assert stats.runtime_calls == 0 and stats.body_edits == len(with_edits(server))


def test_async_client_streamed_and_not():
    async def loop(client, turns):
        raw = [
            {"role": "system", "content": "You fix bugs."},
            {"role": "user", "content": "Fix it."},
        ]
        history = []
        for k in range(turns):
            history.append(copy.deepcopy(raw))
            if k % 2:
                stream = await client.chat.completions.create(
                    model="scripted", messages=raw, tools=TOOLS, stream=True
                )
                run_tools(raw, assemble([ch async for ch in stream]))
            else:
                run_tools(
                    raw,
                    reply_of(
                        await client.chat.completions.create(
                            model="scripted", messages=raw, tools=TOOLS
                        )
                    ),
                )
        return history

    with StubServer(script()) as server:
        base = openai.AsyncOpenAI(base_url=server.base_url, api_key="stub", max_retries=0)
        client = wrap_openai(base, policies=["stale-tool"], session_id="a")
        assert type(client) is openai.AsyncOpenAI
        history = asyncio.run(loop(client, 7))
        check_diffing(server, history, keep=2, session="a")


def test_plain_endpoint_gets_edited_history_and_no_directives():
    with StubServer(script(), leyline_routes=False) as server:
        client = wrap_openai(
            openai.OpenAI(base_url=server.base_url, api_key="stub", max_retries=0),
            policies=["stale-tool"],
        )
        history = sync_loop(client, 6)
        assert [b["messages"] for b in server.chat_bodies()] == [
            expected_send(r, 2) for r in history
        ]
        assert server.directive_bodies() == []
        assert len(server.bodies("/leyline/v1/stats")) == 1


def test_an_explicit_runtime_gets_directives_and_its_failures_let_calls_through():
    with StubServer(script(), directives_status=500) as server:
        client = wrap_openai(
            openai.OpenAI(base_url=server.base_url, api_key="stub", max_retries=0),
            policies=["stale-tool"],
            runtime=HTTPRuntime(server.url),
        )
        history = sync_loop(client, 6)
        assert [b["messages"] for b in server.chat_bodies()] == [
            expected_send(r, 2) for r in history
        ]
        assert all(b["leyline"] == {"client_edits": "off"} for b in server.chat_bodies())
        stats = client.leyline.session().stats
        assert (
            stats.runtime_failures == len(server.directive_bodies()) > 0
            and stats.runtime_calls == 0
        )


def test_sessions_by_extra_body_are_diffed_separately_and_the_key_is_stripped():
    with StubServer(
        ScriptedModel([tool_turn("bash", {"cmd": f"s{k}"}) for k in range(10)])
    ) as server:
        client = wrap_openai(
            openai.OpenAI(base_url=server.base_url, api_key="stub", max_retries=0),
            policies=[StaleToolTruncation(keep=1)],
        )
        raws = {
            "A": [{"role": "user", "content": "task A"}],
            "B": [{"role": "user", "content": "task B"}],
        }
        for _ in range(4):
            for sid, raw in raws.items():
                resp = client.chat.completions.create(
                    model="scripted", messages=raw, extra_body={"leyline_session": sid, "top_k": 5}
                )
                run_tools(raw, reply_of(resp))
        for body in server.chat_bodies():
            assert "leyline_session" not in body and body["top_k"] == 5
        # calls alternate A, B: each chat call names its own session in the header
        assert [h["x-leyline-session"] for h in server.chat_headers()] == ["A", "B"] * 4
        sessions = [h["x-leyline-session"] for h, _ in with_edits(server)]
        assert sorted(sessions) == ["A", "A", "B", "B"]
        for h, b in with_edits(server):
            assert b["messages"][0]["content"] == f"task {h['x-leyline-session']}"
        assert server.directive_bodies() == []
        assert set(client.leyline.sessions) == {"A", "B"}
        assert all(s.stats.resets == 0 for s in client.leyline.sessions.values())


def test_original_client_untouched_and_other_endpoints_pass_through():
    with StubServer(script(3)) as server:
        base = openai.OpenAI(base_url=server.base_url, api_key="stub", max_retries=0)
        client = wrap_openai(base, policies=["stale-tool"], runtime="off")
        assert [m.id for m in client.models.list()] == ["scripted"]
        raw = [{"role": "user", "content": "x"}]
        base.chat.completions.create(model="scripted", messages=raw)
        assert server.chat_bodies()[-1]["messages"] == raw
        assert server.bodies("/leyline/v1/stats") == []  # runtime="off": never asked


def test_bad_history_goes_through_unedited_or_raises_when_strict():
    bad = [
        {"role": "user", "content": "x"},
        {"role": "tool", "tool_call_id": "nope", "content": "y"},
    ]
    with StubServer(script(3)) as server:
        url = server.base_url
        client = wrap_openai(
            openai.OpenAI(base_url=url, api_key="stub", max_retries=0), policies=["stale-tool"]
        )
        client.chat.completions.create(model="scripted", messages=bad)
        assert server.chat_bodies()[-1]["messages"] == bad and client.leyline.failures == 1
        strict = wrap_openai(
            openai.OpenAI(base_url=url, api_key="stub", max_retries=0),
            policies=["stale-tool"],
            strict=True,
        )
        with pytest.raises(TrajectoryError, match=r"messages\[1\]\.tool_call_id"):
            strict.chat.completions.create(model="scripted", messages=bad)
        assert len(server.chat_bodies()) == 1


def test_sdk_message_objects_in_the_history_are_accepted():
    with StubServer(script(5)) as server:
        client = wrap_openai(
            openai.OpenAI(base_url=server.base_url, api_key="stub", max_retries=0),
            policies=[StaleToolTruncation(keep=1)],
        )
        raw: list = [{"role": "user", "content": "go"}]
        for _ in range(4):
            msg = (
                client.chat.completions.create(model="scripted", messages=raw, tools=TOOLS)
                .choices[0]
                .message
            )
            raw.append(msg)  # the SDK object itself, as many agents do
            raw.append(
                {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "out\n" * 30}
            )
        assert client.leyline.failures == 0
        dumped = [
            m.model_dump(exclude_none=True) if hasattr(m, "model_dump") else m for m in raw[:-2]
        ]
        assert server.chat_bodies()[-1]["messages"] == expected_send(dumped, keep=1)
        assert len(with_edits(server)) == 2


def test_stream_as_context_manager_and_a_stream_left_unconsumed():
    with StubServer(script(4)) as server:
        client = wrap_openai(
            openai.OpenAI(base_url=server.base_url, api_key="stub", max_retries=0),
            policies=[StaleToolTruncation(keep=1)],
        )
        raw: list = [{"role": "user", "content": "go"}]
        with client.chat.completions.create(
            model="scripted", messages=raw, tools=TOOLS, stream=True
        ) as stream:
            run_tools(raw, assemble(list(stream)))
        session = client.leyline.session()
        assert session._state.reply is not None  # observed when the stream ended
        stream = client.chat.completions.create(
            model="scripted", messages=raw, tools=TOOLS, stream=True
        )
        first = next(iter(stream))  # the agent reads one chunk and drops the stream
        stream.close()
        assert first.choices[0].delta.role == "assistant" and session._state.reply is None
        # the agent goes on with its own turn: the session trusts the echo, no reset
        run_tools(
            raw,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "own",
                        "type": "function",
                        "function": {"name": "bash", "arguments": '{"cmd": "own"}'},
                    }
                ],
            },
        )
        client.chat.completions.create(model="scripted", messages=raw, tools=TOOLS)
        assert session.stats.resets == 0
        [(_, body)] = with_edits(server)
        own = next(
            i
            for i, m in enumerate(body["messages"])
            if m.get("tool_calls", [{}])[0].get("id") == "own"
        )
        assert body is server.chat_bodies()[-1] and body["leyline"]["edits"]
        assert all(e["index"] < own for e in body["leyline"]["edits"])
        assert server.chat_bodies()[-1]["messages"] == expected_send(raw, keep=1)


def test_user_headers_are_kept_and_a_users_session_header_is_the_calls_session():
    with StubServer(
        ScriptedModel([tool_turn("bash", {"cmd": f"s{k}"}) for k in range(10)])
    ) as server:
        client = wrap_openai(
            openai.OpenAI(base_url=server.base_url, api_key="stub", max_retries=0),
            policies=[StaleToolTruncation(keep=1)],
            session_id="default",
        )
        mine: list = [{"role": "user", "content": "mine"}]
        other: list = [{"role": "user", "content": "other"}]
        for _ in range(3):
            resp = client.chat.completions.create(
                model="scripted", messages=mine, extra_headers={"X-Trace": "t1"}
            )
            run_tools(mine, reply_of(resp))
            resp = client.chat.completions.create(
                model="scripted", messages=other, extra_headers={"x-leyline-session": "own"}
            )
            run_tools(other, reply_of(resp))
        headers = server.chat_headers()
        assert [h["x-trace"] for h in headers[::2]] == ["t1"] * 3  # the user's header stays
        assert [h["x-leyline-session"] for h in headers] == ["default", "own"] * 3  # not overridden
        assert set(client.leyline.sessions) == {"default", "own"}  # ... and it is the session
        for h, b in with_edits(server):
            sid = h["x-leyline-session"]
            assert b["messages"][0]["content"] == {"default": "mine", "own": "other"}[sid]
        assert sorted(h["x-leyline-session"] for h, _ in with_edits(server)) == ["default", "own"]
        with pytest.raises(LeylineError, match=r"contradicts extra_body\.leyline_session"):
            client.chat.completions.create(
                model="scripted",
                messages=mine,
                extra_headers={"X-Leyline-Session": "x"},
                extra_body={"leyline_session": "y"},
            )
        assert len(server.chat_bodies()) == 6  # nothing was sent


def test_the_clients_default_session_header_names_the_session():
    with StubServer(script(3)) as server:
        base = openai.OpenAI(
            base_url=server.base_url,
            api_key="stub",
            max_retries=0,
            default_headers={"X-Leyline-Session": "from-client"},
        )
        client = wrap_openai(base, policies=[StaleToolTruncation(keep=1)])
        assert client.leyline.default_session == "from-client"
        sync_loop(client, 3)
        check_session_headers(server, "from-client")
        assert len(with_edits(server)) == 1
        with pytest.raises(LeylineError, match="session_id: 'other' contradicts"):
            wrap_openai(base, session_id="other")


@pytest.mark.parametrize(
    "where,value,needle",
    [
        ("session_id", "café", "must be ASCII"),
        ("session_id", "", "1 to 256 printable"),
        ("extra_body", "a\nb", r"extra_body\.leyline_session: must be 1 to 256"),
        ("extra_body", 7, r"extra_body\.leyline_session: must be a string"),
        ("extra_headers", "x" * 257, r"extra_headers\['X-Leyline-Session'\]: must be 1 to 256"),
    ],
)
def test_bad_session_ids_are_named_before_anything_is_sent(where, value, needle):
    with StubServer(script(3)) as server:
        base = openai.OpenAI(base_url=server.base_url, api_key="stub", max_retries=0)
        msgs = [{"role": "user", "content": "x"}]
        with pytest.raises(LeylineError, match=needle):
            if where == "session_id":
                wrap_openai(base, session_id=value)
            else:
                kw = (
                    {"extra_body": {"leyline_session": value}}
                    if where == "extra_body"
                    else {"extra_headers": {"X-Leyline-Session": value}}
                )
                wrap_openai(base).chat.completions.create(model="scripted", messages=msgs, **kw)
        assert server.chat_bodies() == []


def test_copies_of_the_wrapped_client_are_wrapped_and_share_its_sessions():
    with StubServer(script(4)) as server:
        client = wrap_openai(
            openai.OpenAI(base_url=server.base_url, api_key="stub", max_retries=0),
            policies=[StaleToolTruncation(keep=1)],
            session_id="s1",
        )
        raw: list = [{"role": "user", "content": "go"}]
        for k in range(4):  # alternate the client and copies of it, as agents do for timeouts
            c = client if k % 2 == 0 else client.with_options(timeout=30)
            run_tools(raw, reply_of(c.chat.completions.create(model="scripted", messages=raw)))
        check_session_headers(server, "s1")
        assert server.chat_bodies()[-1]["messages"] == expected_send(raw[:-2], keep=1)
        assert len(with_edits(server)) == 2  # one session, diffed across the copies
        assert client.with_options().leyline is client.leyline
