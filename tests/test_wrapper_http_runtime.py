"""HTTPRuntime / AsyncHTTPRuntime against the stub server on loopback (real HTTP)."""

from __future__ import annotations

import asyncio
import socket

import pytest

from leyline_agent.errors import DirectiveError, RuntimeUnavailableError
from leyline_agent.http_runtime import (
    AsyncHTTPRuntime,
    HTTPRuntime,
    NoLeylineRoutesError,
    server_root,
)
from leyline_agent.protocols import AsyncRuntime, Runtime
from leyline_agent.testing.scripted import ScriptedModel
from leyline_agent.testing.stub_server import StubServer
from leyline_agent.wire import DirectivesRequest

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
        rt = HTTPRuntime(server.base_url + "/v1/", api_key="k")
        resp = rt.apply_directives(request())
        assert resp.splices == {"amortize": 1}
        [body] = server.directive_bodies()
        assert body == request().model_dump(mode="json", exclude_none=True)
        assert rt.stats().splices["amortize"] == 1
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
        bad = {"old_messages": OLD}  # message form missing new_messages: the server says 422
        resp = rt._client.post(server.base_url + "/leyline/v1/directives", json=bad)
        assert resp.status_code == 422
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


def test_a_post_that_reached_the_server_is_not_retried():
    with StubServer(ScriptedModel([]), directives_delay_s=1.0) as server:
        rt = HTTPRuntime(server.base_url, timeout=0.2, retries=3, backoff_s=0.01)
        with pytest.raises(RuntimeUnavailableError, match="ReadTimeout") as info:
            rt.apply_directives(request())
        assert "attempts" not in str(info.value)
        assert len(server.directive_bodies()) == 1
