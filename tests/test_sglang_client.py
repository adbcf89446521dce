"""``SGLangRuntime`` and the HTTP route (on SGLang's real FastAPI app) over the real tree + MLA pool.

Only the two transports that need a GPU server are stood in for, each by what it does:
``Engine.generate`` / ``TokenizerManager.generate_request`` by a prefill into the real
cache (``sglang_pools.prefill``), ``collective_rpc`` / the RPC socket by calling the
scheduler method and turning a failure into its message (as ``Engine.collective_rpc``
does with ``assert recv_req.success, recv_req.message``). Expected KV: ``RefState``
(the model's own RoPE on hook-captured pre-RoPE keys), chained the same way.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from leyline_agent.directives import Directive, Mode, apply_directives
from leyline_agent.errors import CacheMissError
from leyline_agent.http_runtime import HTTPRuntime
from leyline_agent.runtime.engine import Engine
from leyline_agent.sglang_plugin import scheduler_hook as hook
from leyline_agent.sglang_plugin.client import SGLangRuntime
from leyline_agent.sglang_plugin.http_route import LeylineRoute, before_http_server
from leyline_agent.sglang_plugin.treeview import peek_prefix
from leyline_agent.testing import sglang_pools as sp
from leyline_agent.testing.kv_reference import RefState
from leyline_agent.testing.models import tiny_model_dir
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


class Loopback:
    """``sglang.Engine``'s two calls, landing on the real cache of one scheduler rank."""

    def __init__(self, engine: Engine) -> None:
        self.cache = sp.build_cache(engine.config, size=1024)
        self.model = engine.model
        self.scheduler = SimpleNamespace(
            tree_cache=self.cache.tree,
            token_to_kv_pool_allocator=self.cache.allocator,
            model_config=SimpleNamespace(hf_config=engine.config),
        )
        hook.install(self.scheduler)
        self.tokenizer_manager = SimpleNamespace(
            tokenizer=engine.tokenizer, generate_request=self._generate_request
        )

    def generate(self, input_ids, sampling_params) -> dict:
        assert sampling_params["max_new_tokens"] >= 1
        sp.prefill(self.cache, self.model, input_ids)
        return {}

    async def _generate_request(self, obj, request):
        yield self.generate(obj.input_ids, obj.sampling_params)

    def collective_rpc(self, method: str, **kwargs) -> None:
        try:
            getattr(self.scheduler, method)(**kwargs)
        except Exception as e:
            raise AssertionError(str(e)) from e


def _kpe(cache: sp.SGLangCache, tokens: list[int]) -> list[torch.Tensor]:
    p = peek_prefix(cache.tree, tokens)
    assert p.length == len(tokens)
    return [r[1] for r in sp.rows(cache, p.slots)]


def test_sglang_runtime_batch_matches_reference(engine: Engine) -> None:
    loop = Loopback(engine)
    rt = SGLangRuntime(loop)
    tokens = engine.render(MESSAGES, add_generation_prompt=False)
    r1 = engine.tokenizer.encode("[stub]", add_special_tokens=False)
    r2 = engine.tokenizer.encode("[tool output removed: 14 tokens]", add_special_tokens=False)
    sp.prefill(loop.cache, engine.model, tokens)
    ds = [Directive(start=8, end=14, replacement=r1), Directive(start=30, end=44, replacement=r2)]

    resp = rt.apply_directives(DirectivesRequest(tokens=tokens, directives=ds))

    final = apply_directives(tokens, ds)
    assert resp.tokens == final and resp.splices == {"amortize": 2, "forget": 0}
    ref = RefState.prefill(engine.model, tokens).amortize(30, 44, r2).amortize(8, 14, r1).kv()
    for layer, kpe in enumerate(_kpe(loop.cache, final)):
        torch.testing.assert_close(kpe, ref[layer][1][0, 0], rtol=1e-4, atol=5e-5)
    assert rt.stats().splices["amortize"] == 2

    # FORGET goes through the normal prefill: the whole new sequence is cached fresh
    d = Directive(start=20, end=25, replacement=r1, mode=Mode.FORGET)
    resp = rt.apply_directives(DirectivesRequest(tokens=final, directives=[d]))
    assert resp.splices == {"amortize": 0, "forget": 1}
    assert peek_prefix(loop.cache.tree, resp.tokens).length == len(resp.tokens)
    sp.evict_all(loop.cache)
    assert loop.cache.allocator.available_size() == loop.cache.initial_free


def test_sglang_runtime_errors_and_fallback(engine: Engine) -> None:
    loop = Loopback(engine)
    rt = SGLangRuntime(loop)
    never = engine.tokenizer.encode("never sent to this server", add_special_tokens=False)
    req = DirectivesRequest(tokens=never, directives=[Directive(start=1, end=3, replacement=[9])])
    snap = sp.snapshot(loop.cache)
    with pytest.raises(CacheMissError, match="not in the radix cache"):
        rt.apply_directives(req)
    resp = rt.apply_directives(req.model_copy(update={"fallback": True}))
    assert resp.fallback and resp.rotated_tokens == 0
    sp.snapshot(loop.cache).assert_equal(snap)  # refused before the head was prefilled
    assert rt.stats().fallbacks == 1 and rt.stats().directive_errors == 1


def test_sglang_runtime_message_form(engine: Engine) -> None:
    loop = Loopback(engine)
    rt = SGLangRuntime(loop)
    old = engine.render(MESSAGES, add_generation_prompt=False)
    sp.prefill(loop.cache, engine.model, old[:-1])  # SGLang caches all but the last token
    new_messages = [dict(m) for m in MESSAGES]
    new_messages[3]["content"] = "[stale tool output removed]"
    resp = rt.apply_directives(DirectivesRequest(old_messages=MESSAGES, new_messages=new_messages))
    new = engine.render(new_messages, add_generation_prompt=False)
    assert resp.tokens == new and resp.splices["amortize"] == 1
    assert peek_prefix(loop.cache.tree, new).length == len(new) - 1


def test_sglang_http_route_on_sglang_app(engine: Engine, monkeypatch) -> None:
    """The BEFORE hook adds the routes to SGLang's real FastAPI app; requests go through it."""
    import sglang.srt.entrypoints.http_server as http_server
    from fastapi.testclient import TestClient

    monkeypatch.setattr(http_server.app.router, "routes", list(http_server.app.router.routes))
    loop = Loopback(engine)

    async def rpc(self, kwargs, method):  # the socket round trip: RpcReqOutput(success, message)
        try:
            getattr(loop.scheduler, method)(**kwargs)
        except Exception as e:
            err = hook.error_from_message(str(e))
            raise (err if err is not None else e) from None

    monkeypatch.setattr(LeylineRoute, "_rpc", rpc)
    before_http_server(None, loop.tokenizer_manager, None, SimpleNamespace(rpc_ipc_name="ipc://x"))
    client = TestClient(http_server.app)
    tokens = engine.render(MESSAGES, add_generation_prompt=False)
    sp.prefill(loop.cache, engine.model, tokens)
    body = {"tokens": tokens, "directives": [{"start": 30, "end": 44, "replacement": "[x]"}]}
    r = client.post("/leyline/v1/directives", json=body)
    assert r.status_code == 200, r.text
    out = DirectivesResponse.model_validate(r.json())
    assert peek_prefix(loop.cache.tree, out.tokens).length == len(out.tokens)
    assert out.splices == {"amortize": 1, "forget": 0}

    r = client.post("/leyline/v1/directives", json={"tokens": tokens})
    assert r.status_code == 422 and "directives" in r.json()["error"]["message"]
    body["directives"][0]["end"] = len(tokens) + 9
    r = client.post("/leyline/v1/directives", json=body)
    assert r.status_code == 400 and r.json()["error"]["type"] == "DirectiveError"
    never = engine.tokenizer.encode("not cached", add_special_tokens=False)
    miss = {"tokens": never, "directives": [{"start": 0, "end": 1, "replacement": "[x]"}]}
    r = client.post("/leyline/v1/directives", json=miss)
    assert r.status_code == 409 and r.json()["error"]["type"] == "CacheMissError"
    stats = StatsResponse.model_validate(client.get("/leyline/v1/stats").json())
    assert stats.directive_errors == 3 and stats.splices["amortize"] == 1

    # the agent side's HTTPRuntime works against it as against `leyline serve`
    rt = HTTPRuntime("http://testserver", client=client)
    assert rt.has_leyline()
    d = Directive(start=8, end=14, replacement=[5, 6])
    resp = rt.apply_directives(DirectivesRequest(tokens=out.tokens, directives=[d]))
    assert resp.tokens == apply_directives(out.tokens, [d])
    assert peek_prefix(loop.cache.tree, resp.tokens).length == len(resp.tokens)
    with pytest.raises(CacheMissError):
        rt.apply_directives(DirectivesRequest(**miss))
