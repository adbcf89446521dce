"""HTTPRuntime / AsyncHTTPRuntime against the stub server on loopback (real HTTP)."""

from __future__ import annotations

import asyncio
import email.utils
import re
import socket
import time

import httpx
import pytest

from leyline_agent.agent.http_runtime import (
    AsyncHTTPRuntime,
    AuthenticationError,
    HTTPRuntime,
    NoLeylineRoutesError,
    retry_after_s,
    server_root,
)
from leyline_agent.errors import DirectiveError, RuntimeUnavailableError
from leyline_agent.protocols import AsyncRuntime, Runtime
from leyline_agent.testing.scripted import ScriptedModel
from leyline_agent.testing.stub_server import StubServer
from leyline_agent.wire import DirectivesRequest

pytestmark = pytest.mark.slow

OLD = [{"role": "user", "content": "go"}, {"role": "assistant", "content": "ok"}]
NEW = [{"role": "user", "content": "go"}, {"role": "assistant", "content": "[elided]"}]


def request(**kw) -> DirectivesRequest:
    return DirectivesRequest(old_messages=OLD, new_messages=NEW, session="s", **kw)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_server_root():
    assert server_root("http://h:1/v1/") == "http://h:1"
    assert server_root("http://h:1/v1") == "http://h:1"
    assert server_root("https://h/api/") == "https://h/api"
    with pytest.raises(RuntimeUnavailableError, match="base_url"):
        server_root("h:1/v1")


def test_apply_and_stats_round_trip():
    with StubServer(ScriptedModel([])) as server:
        rt = HTTPRuntime(server.base_url + "/", api_key="k")
        resp = rt.apply_directives(request())
        assert resp.splices == {"amortize": 1}
        [body] = server.directive_bodies()
        request_id = body.pop("request_id")
        assert re.fullmatch(r"[0-9a-f]{32}", request_id)
        assert body == request().model_dump(mode="json", exclude_none=True)
        [headers] = server.directive_headers()
        assert headers["authorization"] == "Bearer k"
        assert headers["x-leyline-session"] == "s"
        assert rt.stats().splices["amortize"] == 1
        assert server.headers("/leyline/v1/stats")[0]["authorization"] == "Bearer k"
        assert rt.has_leyline()
        assert isinstance(rt, Runtime) and isinstance(
            AsyncHTTPRuntime(server.base_url), AsyncRuntime
        )


def test_plain_endpoint_is_detected_not_raised():
    with StubServer(ScriptedModel([]), leyline_routes=False) as server:
        rt = HTTPRuntime(server.base_url)
        assert rt.has_leyline() is False
        with pytest.raises(NoLeylineRoutesError, match="no Leyline routes"):
            rt.apply_directives(request())


def test_server_errors_map_to_leyline_errors():
    with StubServer(ScriptedModel([])) as server:
        rt = HTTPRuntime(server.base_url)
        bad = {"old_messages": OLD}  # message form missing new_messages: the server says 400
        resp = rt._client.post(server.url + "/leyline/v1/directives", json=bad)
        assert resp.status_code == 400
        with pytest.raises(DirectiveError, match="new_messages"):
            rt._parse("/leyline/v1/directives", resp, DirectivesRequest)
    with StubServer(ScriptedModel([]), directives_status=500) as server:
        with pytest.raises(RuntimeUnavailableError, match="HTTP 500"):
            HTTPRuntime(server.base_url).apply_directives(request())


def test_unreachable_server_is_retried_then_unavailable():
    port = free_port()
    rt = HTTPRuntime(f"http://127.0.0.1:{port}", retries=3, backoff_s=0.01, timeout=2)
    with pytest.raises(
        RuntimeUnavailableError, match=r"cannot reach .* after 3 attempts: ConnectError"
    ):
        rt.apply_directives(request())
    with pytest.raises(RuntimeUnavailableError):
        rt.has_leyline()


def test_async_twin():
    async def main(base: str, port: int):
        rt = AsyncHTTPRuntime(base)
        resp = await rt.apply_directives(request(fallback=True))
        stats = await rt.stats()
        has = await rt.has_leyline()
        await rt.aclose()
        down = AsyncHTTPRuntime(f"http://127.0.0.1:{port}", retries=2, backoff_s=0.01)
        with pytest.raises(RuntimeUnavailableError, match="after 2 attempts"):
            await down.stats()
        return resp, stats, has

    with StubServer(ScriptedModel([])) as server:
        resp, stats, has = asyncio.run(main(server.base_url, free_port()))
        assert resp.splices == {"amortize": 1} and stats.splices["amortize"] == 1 and has
        assert server.directive_bodies()[0]["fallback"] is True


def test_a_post_the_server_is_slow_to_answer_is_not_retried():
    # a read timeout: the server may still be executing it; asking again only queues a copy
    with StubServer(ScriptedModel([]), directives_delay_s=1.0) as server:
        rt = HTTPRuntime(server.base_url, timeout=0.2, retries=3, backoff_s=0.01)
        with pytest.raises(RuntimeUnavailableError, match="ReadTimeout") as info:
            rt.apply_directives(request())
        assert "attempts" not in str(info.value)
        assert len(server.directive_bodies()) == 1


def apply(is_async: bool, rt_args: dict, base: str, req: DirectivesRequest):
    """``apply_directives`` on a fresh (Async)HTTPRuntime, from sync code."""
    if not is_async:
        return HTTPRuntime(base, **rt_args).apply_directives(req)

    async def main():
        rt = AsyncHTTPRuntime(base, **rt_args)
        try:
            return await rt.apply_directives(req)
        finally:
            await rt.aclose()

    return asyncio.run(main())


FAST = {"retries": 3, "backoff_s": 0.01, "timeout": 5}


@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize(
    "faults", [["reset"], ["close"], ["503"], ["502", "504"]], ids=lambda f: "+".join(f)
)
def test_a_directive_retried_after_the_server_received_it_keeps_its_request_id(is_async, faults):
    with StubServer(ScriptedModel([]), directive_faults=faults) as server:
        resp = apply(is_async, {**FAST, "api_key": "k"}, server.base_url, request())
        assert resp.splices == {"amortize": 1}
        bodies = server.directive_bodies()
        assert len(bodies) == len(faults) + 1  # each failed attempt reached the server
        ids = {b["request_id"] for b in bodies}
        assert len(ids) == 1 and re.fullmatch(r"[0-9a-f]{32}", ids.pop())
        assert {b["session"] for b in bodies} == {"s"}
        for h in server.directive_headers():  # every attempt carries key and session
            assert h["authorization"] == "Bearer k" and h["x-leyline-session"] == "s"


def test_each_directive_gets_a_fresh_request_id_unless_it_names_one():
    with StubServer(ScriptedModel([])) as server:
        rt = HTTPRuntime(server.base_url)
        rt.apply_directives(request())
        rt.apply_directives(request())
        rt.apply_directives(request(request_id="mine-1"))
        a, b, c = (body["request_id"] for body in server.directive_bodies())
        assert a != b and c == "mine-1"


@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
def test_a_5xx_without_a_usable_retry_after_is_not_retried(is_async):
    for retry_after in (None, "60", "soon"):  # none, longer than max_retry_after_s, bad
        with StubServer(
            ScriptedModel([]), directive_faults=["503"], retry_after=retry_after
        ) as server:
            with pytest.raises(RuntimeUnavailableError, match="HTTP 503"):
                apply(is_async, {**FAST, "max_retry_after_s": 10}, server.base_url, request())
            assert len(server.directive_bodies()) == 1, retry_after


def test_retry_after_waits_as_asked_and_the_attempts_run_out():
    with StubServer(ScriptedModel([]), directive_faults=["503"] * 3, retry_after="1") as server:
        t0 = time.monotonic()
        with pytest.raises(RuntimeUnavailableError, match="HTTP 503") as info:
            HTTPRuntime(server.base_url, **FAST).apply_directives(request())
        assert time.monotonic() - t0 >= 2.0  # two waits of Retry-After: 1
        assert "StubFailure" in str(info.value)
        assert len(server.directive_bodies()) == 3
        assert len({b["request_id"] for b in server.directive_bodies()}) == 1


def test_retry_after_as_seconds_or_date():
    def resp(status, value):
        return httpx.Response(status, headers={"Retry-After": value} if value else {})

    assert retry_after_s(resp(503, "3")) == 3.0
    assert retry_after_s(resp(502, "0")) == 0.0
    assert retry_after_s(resp(503, None)) is None
    assert retry_after_s(resp(500, "3")) is None  # only 502/503/504 ask to come back
    assert retry_after_s(resp(503, "-1")) is None
    later = email.utils.formatdate(time.time() + 30, usegmt=True)
    assert 25 <= retry_after_s(resp(504, later)) <= 30


@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
def test_401_is_an_authentication_error_and_never_retried(is_async):
    with StubServer(ScriptedModel([]), api_key="right") as server:
        with pytest.raises(AuthenticationError, match="HTTP 401: no API key was given"):
            apply(is_async, FAST, server.base_url, request())
        with pytest.raises(AuthenticationError, match="HTTP 401: the API key was refused"):
            apply(is_async, {**FAST, "api_key": "wrong"}, server.base_url, request())
        assert len(server.directive_bodies()) == 2  # one attempt each
        resp = apply(is_async, {**FAST, "api_key": "right"}, server.base_url, request())
        assert resp.splices == {"amortize": 1}
        rt = HTTPRuntime(server.base_url, **FAST)
        with pytest.raises(AuthenticationError):
            rt.has_leyline()  # not "no Leyline routes": the routes are there, the key is not
        assert len(server.bodies("/leyline/v1/stats")) == 1
