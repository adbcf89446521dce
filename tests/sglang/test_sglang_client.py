"""``SGLangRuntime`` and the HTTP route (on SGLang's real FastAPI app) over the real tree + MLA pool.

Only the two transports that need a GPU server are stood in for, each by what it does:
``TokenizerManager.generate_request`` by what the scheduler does with the request (the
plugin's routing hook picks the radix namespace, then a prefill into the real cache,
``sglang_pools.prefill``), the RPC socket by what ``Scheduler.handle_rpc_request`` does
under the plugin's hook (``LoopbackEngine.handle_rpc``: call the scheduler method, a
failure becomes its message, an answer rides in the reply). Expected KV: ``RefState`` (the
model's own RoPE on hook-captured pre-RoPE keys), chained the same way.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from leyline_agent.agent.http_runtime import HTTPRuntime
from leyline_agent.directives import Directive, Mode, splice_tokens
from leyline_agent.engine.checkpoints.store import tiny_model_dir
from leyline_agent.engine.engine import Engine
from leyline_agent.errors import CacheMissError
from leyline_agent.namespaces import Namespace
from leyline_agent.reference.kv_reference import RefState
from leyline_agent.sglang_plugin.client import SGLangRuntime
from leyline_agent.sglang_plugin.http_route import SGLangRoute, before_http_server
from leyline_agent.sglang_plugin.routing import route_key
from leyline_agent.sglang_plugin.treeview import peek_prefix
from leyline_agent.testing import sglang_pools as sp
from leyline_agent.wire import DirectivesRequest, DirectivesResponse, StatsResponse

MESSAGES = [
    {"role": "system", "content": "You fix bugs."},
    {"role": "user", "content": "Why does test_load fail?"},
    {"role": "assistant", "content": "Let me run it."},
    {"role": "tool", "content": "E KeyError: 'path' in config.py line 12, see traceback above"},
    {"role": "assistant", "content": "The config lacks a path key."},
]


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine.from_pretrained(tiny_model_dir("deepseek_v2"))


ANON = Namespace().key


Loopback = sp.LoopbackEngine


@pytest.fixture()
def loop(engine: Engine):
    lb = Loopback(engine.model, engine.tokenizer, size=1024)
    yield lb
    lb.close()


def _served(cache: sp.SGLangCache, tokens: list[int], ns: str = ANON):
    """What a request of namespace ``ns`` for ``tokens`` is served (the tree routing picks)."""
    return peek_prefix(cache.tree, tokens, route_key(cache.tree, tokens, ns))


def _kpe(cache: sp.SGLangCache, tokens: list[int], ns: str = ANON) -> list[torch.Tensor]:
    p = _served(cache, tokens, ns)
    assert p.length == len(tokens)
    return [r[1] for r in sp.rows(cache, p.slots)]


def test_sglang_runtime_batch_matches_reference(engine: Engine, loop: Loopback) -> None:
    rt = SGLangRuntime(loop)
    tokens = engine.render(MESSAGES, add_generation_prompt=False)
    r1 = engine.tokenizer.encode("[stub]", add_special_tokens=False)
    r2 = engine.tokenizer.encode("[tool output removed: 14 tokens]", add_special_tokens=False)
    sp.prefill(loop.cache, engine.model, tokens)
    ds = [Directive(start=8, end=14, replacement=r1), Directive(start=30, end=44, replacement=r2)]

    resp = rt.apply_directives(DirectivesRequest(tokens=tokens, directives=ds))

    final = splice_tokens(tokens, ds)
    assert resp.tokens == final and resp.splices == {"amortize": 2, "forget": 0}
    ref = RefState.prefill(engine.model, tokens).amortize(30, 44, r2).amortize(8, 14, r1).kv()
    for layer, kpe in enumerate(_kpe(loop.cache, final)):
        torch.testing.assert_close(kpe, ref[layer][1][0, 0], rtol=1e-4, atol=5e-5)
    assert rt.stats().splices["amortize"] == 2

    # FORGET goes through the normal prefill: the whole new sequence is cached fresh
    d = Directive(start=20, end=25, replacement=r1, mode=Mode.FORGET)
    resp = rt.apply_directives(DirectivesRequest(tokens=final, directives=[d]))
    assert resp.splices == {"amortize": 0, "forget": 1}
    assert _served(loop.cache, resp.tokens).length == len(resp.tokens)
    assert loop.cache.allocator.available_size() + sp.held_slots(loop.cache) == 1024
    sp.evict_all(loop.cache)
    assert loop.cache.allocator.available_size() == loop.cache.initial_free


def test_sglang_runtime_errors_and_fallback(engine: Engine, loop: Loopback) -> None:
    rt = SGLangRuntime(loop)
    never = engine.tokenizer.encode("never sent to this server", add_special_tokens=False)
    req = DirectivesRequest(tokens=never, directives=[Directive(start=1, end=3, replacement=[9])])
    snap = sp.snapshot(loop.cache)
    with pytest.raises(CacheMissError) as miss:
        rt.apply_directives(req)
    assert str(miss.value) == (  # the pipeline's message, as leyline serve and vLLM word it
        "directives[0]: span [1, 3) of 'tokens' is not cached "
        f"(the prefix cache holds its first 0 of {len(never)} tokens)"
    )
    resp = rt.apply_directives(req.model_copy(update={"fallback": True}))
    assert resp.outcome == "fallback" and resp.fallback and resp.rotated_tokens == 0
    assert resp.tokens == splice_tokens(never, req.directives) and resp.splices == {}
    sp.snapshot(loop.cache).assert_equal(snap)  # refused before the head was prefilled
    assert rt.stats().fallbacks == 1 and rt.stats().directive_errors == 1


def test_sglang_runtime_message_form(engine: Engine, loop: Loopback) -> None:
    rt = SGLangRuntime(loop)
    old = engine.render(MESSAGES, add_generation_prompt=False)
    sp.prefill(loop.cache, engine.model, old[:-1])  # SGLang caches all but the last token
    new_messages = [dict(m) for m in MESSAGES]
    new_messages[3]["content"] = "[stale tool output removed]"
    resp = rt.apply_directives(DirectivesRequest(old_messages=MESSAGES, new_messages=new_messages))
    new = engine.render(new_messages, add_generation_prompt=False)
    assert resp.tokens == new and resp.splices["amortize"] == 1
    assert _served(loop.cache, new).length == len(new) - 1


def test_sglang_message_form_decides_as_every_backend(engine: Engine, loop: Loopback) -> None:
    """The pipeline's decision on SGLang: an edit past the cached prefix is refused whole
    without ``fallback`` (the same 409 message as ``leyline serve``), its cached part is
    spliced with it; an unchanged conversation is a noop that asks the cache nothing."""
    rt = SGLangRuntime(loop)
    old = engine.render(MESSAGES, add_generation_prompt=False)
    new_messages = [dict(m) for m in MESSAGES]
    new_messages[1]["content"] = "Why does test_save fail?"
    new_messages[3]["content"] = "[stale tool output removed]"
    new = engine.render(new_messages, add_generation_prompt=False)
    tool_at = len(engine.render(MESSAGES[:3], add_generation_prompt=False))
    sp.prefill(loop.cache, engine.model, old[: tool_at + 5])  # the tool result's head only
    req = DirectivesRequest(old_messages=MESSAGES, new_messages=new_messages)
    snap = sp.snapshot(loop.cache)
    with pytest.raises(CacheMissError) as miss:
        rt.apply_directives(req)
    assert str(miss.value).startswith("old_messages: the edits span tokens [")
    assert str(miss.value).endswith(
        f"but only its first {tool_at + 5} tokens are cached "
        "(without fallback no edit is applied in part)"
    )
    sp.snapshot(loop.cache).assert_equal(snap)  # refused before anything ran

    resp = rt.apply_directives(req.model_copy(update={"fallback": True}))
    assert resp.outcome == "applied" and resp.tokens == new
    assert resp.cached_base_tokens == tool_at + 5 and len(resp.applied) == 2
    user, tool = resp.applied[1], resp.applied[0]  # right to left
    assert user.end < tool_at < tool.start and tool.end == tool_at + 5  # clipped to the cache
    assert resp.splices == {"amortize": 2, "forget": 0}

    same = rt.apply_directives(DirectivesRequest(old_messages=MESSAGES, new_messages=MESSAGES))
    assert (same.outcome, same.tokens, same.applied) == ("noop", old, [])
    assert rt.stats().directive_errors == 1


def test_sglang_http_route_on_sglang_app(engine: Engine, loop: Loopback, monkeypatch) -> None:
    """The BEFORE hook adds the routes to SGLang's real FastAPI app; requests go through it."""
    import sglang.srt.entrypoints.http_server as http_server
    from fastapi.testclient import TestClient

    monkeypatch.setattr(http_server.app.router, "routes", list(http_server.app.router.routes))

    async def round_trip(self, req):  # the socket round trip: RpcReqOutput(success, message)
        return loop.handle_rpc(req)

    monkeypatch.setattr(SGLangRoute, "round_trip", round_trip)
    before_http_server(None, loop.tokenizer_manager, None, SimpleNamespace(rpc_ipc_name="ipc://x"))
    client = TestClient(http_server.app)
    tokens = engine.render(MESSAGES, add_generation_prompt=False)
    sp.prefill(loop.cache, engine.model, tokens)
    body = {"tokens": tokens, "directives": [{"start": 30, "end": 44, "replacement": "[x]"}]}
    r = client.post("/leyline/v1/directives", json=body)
    assert r.status_code == 200, r.text
    out = DirectivesResponse.model_validate(r.json())
    assert _served(loop.cache, out.tokens).length == len(out.tokens)
    assert out.splices == {"amortize": 1, "forget": 0}

    r = client.post("/leyline/v1/directives", json={"tokens": tokens})
    assert r.status_code == 400 and "directives" in r.json()["error"]["message"]
    body["directives"][0]["end"] = len(tokens) + 9
    r = client.post("/leyline/v1/directives", json=body)
    assert r.status_code == 400 and r.json()["error"]["leyline_type"] == "DirectiveError"
    never = engine.tokenizer.encode("not cached", add_special_tokens=False)
    miss = {"tokens": never, "directives": [{"start": 0, "end": 1, "replacement": "[x]"}]}
    r = client.post("/leyline/v1/directives", json=miss)
    assert r.status_code == 409 and r.json()["error"]["leyline_type"] == "CacheMissError"
    stats = StatsResponse.model_validate(client.get("/leyline/v1/stats").json())
    assert stats.directive_errors == 1 and stats.splices["amortize"] == 1  # the miss only

    # the agent side's HTTPRuntime works against it as against `leyline serve`
    rt = HTTPRuntime("http://testserver", client=client)
    assert rt.has_leyline()
    d = Directive(start=8, end=14, replacement=[5, 6])
    resp = rt.apply_directives(DirectivesRequest(tokens=out.tokens, directives=[d]))
    assert resp.tokens == splice_tokens(out.tokens, [d])
    assert _served(loop.cache, resp.tokens).length == len(resp.tokens)
    with pytest.raises(CacheMissError):
        rt.apply_directives(DirectivesRequest(**miss))


def test_sglang_http_route_sessions(engine: Engine, loop: Loopback, monkeypatch) -> None:
    """``X-Leyline-Session`` (or the body's ``session``) names the namespace the splice goes
    to; the header and the body must agree."""
    import sglang.srt.entrypoints.http_server as http_server
    from fastapi.testclient import TestClient

    monkeypatch.setattr(http_server.app.router, "routes", list(http_server.app.router.routes))

    async def round_trip(self, req):
        return loop.handle_rpc(req)

    monkeypatch.setattr(SGLangRoute, "round_trip", round_trip)
    before_http_server(None, loop.tokenizer_manager, None, SimpleNamespace(rpc_ipc_name="ipc://x"))
    client = TestClient(http_server.app)
    tokens = engine.render(MESSAGES, add_generation_prompt=False)
    sp.prefill(loop.cache, engine.model, tokens)
    d = {"start": 30, "end": 44, "replacement": "[x]"}
    body = {"tokens": tokens, "directives": [d]}
    r = client.post("/leyline/v1/directives", json=body, headers={"X-Leyline-Session": "a"})
    assert r.status_code == 200, r.text
    new = r.json()["tokens"]
    r = client.post("/leyline/v1/directives", json={**body, "session": "b"})
    assert r.status_code == 200, r.text
    for s in ("a", "b"):
        assert peek_prefix(loop.cache.tree, new, Namespace(session=s).key).length == len(new)
    assert peek_prefix(loop.cache.tree, new, ANON).length == 0
    assert peek_prefix(loop.cache.tree, new, None).length < len(new)

    r = client.post(
        "/leyline/v1/directives", json={**body, "session": "b"}, headers={"X-Leyline-Session": "a"}
    )
    assert r.status_code == 400 and r.json()["error"]["leyline_type"] == "RequestError"
    assert "X-Leyline-Session" in r.json()["error"]["message"]
    r = client.post("/leyline/v1/directives", json={**body, "session": ""})
    assert r.status_code == 400 and "session" in r.json()["error"]["message"]
