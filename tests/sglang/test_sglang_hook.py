"""The plugin's wiring into SGLang 0.5.23, as far as it runs without a GPU.

- the ``sglang.srt.plugins`` entry point is discovered and loaded by SGLang's own loader;
  ``register`` adds the hooks and the ``leyline`` radix-cache backend;
- the hooks are applied by SGLang's ``HookRegistry`` to the real ``Scheduler`` class;
- the real ``Scheduler.handle_rpc_request`` (what ``collective_rpc`` reaches on every rank)
  runs ``leyline_splice`` on an object holding the real tree/allocator/MLA pool, with the
  request passed through SGLang's own msgpack IPC encoding; a single-process gloo group
  stands in for the TP group of its barrier;
- ``leyline_lookup``'s answer (the base's cached length in a namespace) rides back in the
  successful ``RpcReqOutput``'s message, put there by the plugin's hook on
  ``handle_rpc_request``;
- failures come back as ``RpcReqOutput(success=False)`` carrying the Leyline error class;
- the request hooks, applied by ``HookRegistry`` to the real ``TokenizerManager`` and
  ``Scheduler`` methods: the ``X-Leyline-Session`` header becomes the request's extra key,
  and the scheduler routes the request to the session's tree or the plain one.

Not exercised here (needs CUDA + full SGLang): a live Scheduler process, the ZMQ sockets,
the HTTP server (``http_route``), ``Engine.collective_rpc`` itself.
"""

from __future__ import annotations

import json
from collections import defaultdict
from types import SimpleNamespace

import pytest

from leyline_agent.directives import Directive
from leyline_agent.engine.checkpoints.store import tiny_model_dir
from leyline_agent.engine.engine import Engine
from leyline_agent.errors import CacheMissError, DirectiveError, RuntimeUnavailableError
from leyline_agent.namespaces import Namespace
from leyline_agent.sglang_plugin import scheduler_hook as hook
from leyline_agent.sglang_plugin.treeview import peek_prefix
from leyline_agent.testing import sglang_pools as sp

ANON = Namespace().key
MESSAGES = [
    {"role": "user", "content": "Run the tests."},
    {"role": "assistant", "content": "Running pytest."},
    {"role": "tool", "content": "3 failed, 12 passed in 0.41s"},
]


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine.from_pretrained(tiny_model_dir("deepseek_v2"))


@pytest.fixture()
def scheduler(engine: Engine):
    """What ``leyline_splice`` reads off a Scheduler, holding SGLang's real classes."""
    cache = sp.build_cache(engine.config, size=256)
    fake = SimpleNamespace(
        tree_cache=cache.tree,
        token_to_kv_pool_allocator=cache.allocator,
        model_config=SimpleNamespace(hf_config=engine.config),
        tp_group=SimpleNamespace(cpu_group=None),
    )
    hook.after_scheduler_init(None, fake)
    return fake, cache


def test_sglang_rpc_kwargs_round_trip() -> None:
    d = Directive(start=3, end=9, replacement=[7, 8])
    kw = hook.encode_splice_kwargs([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], d)
    assert all(isinstance(v, (str, int)) for v in kw.values()), "collective_rpc takes flat scalars"
    tokens, back, ns = hook.decode_splice_kwargs(**kw)
    assert tokens == json.loads(kw["tokens_json"]) and back == d and ns == ANON
    kw_b = hook.encode_splice_kwargs([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], d, Namespace(session="b").key)
    assert hook.decode_splice_kwargs(**kw_b)[2] == Namespace(session="b").key
    with pytest.raises(DirectiveError, match="namespace"):
        hook.decode_splice_kwargs(**{**kw, "namespace": "not-ours"})
    with pytest.raises(DirectiveError, match="tokens_json"):
        hook.decode_splice_kwargs(**{**kw, "tokens_json": "[1, 2,"})
    with pytest.raises(DirectiveError, match=r"replacement_json\[1\]"):
        hook.decode_splice_kwargs(**{**kw, "replacement_json": "[4, -1]"})
    with pytest.raises(DirectiveError, match="start"):
        hook.decode_splice_kwargs(**{**kw, "start": -2})


def test_sglang_scheduler_method_splices_real_cache(engine: Engine, scheduler) -> None:
    fake, cache = scheduler
    tokens = engine.render(MESSAGES)
    repl = engine.tokenizer.encode("[ok]", add_special_tokens=False)
    d = Directive(start=12, end=20, replacement=repl)
    sp.prefill(cache, engine.model, tokens)
    sp.prefill(cache, engine.model, tokens[:12] + repl)
    fake.leyline_splice(**hook.encode_splice_kwargs(tokens, d))
    new_tokens = tokens[:12] + repl + tokens[20:]
    assert peek_prefix(cache.tree, new_tokens, ANON).length == len(new_tokens)

    snap = sp.snapshot(cache)
    missing = engine.tokenizer.encode("never cached", add_special_tokens=False)
    with pytest.raises(hook.SpliceRpcError) as info:
        fake.leyline_splice(**hook.encode_splice_kwargs(missing, Directive(start=0, end=1)))
    assert str(info.value).startswith("leyline:CacheMissError: ")
    assert isinstance(hook.error_from_message(str(info.value)), CacheMissError)
    sp.snapshot(cache).assert_equal(snap)
    sp.evict_all(cache)
    assert cache.allocator.available_size() == cache.initial_free


@pytest.fixture()
def isolated_hooks(monkeypatch):
    """Apply hooks for real, then put SGLang's classes, registries and modules back."""
    import sglang.srt.entrypoints.http_server as http_server
    import sglang.srt.mem_cache.registry as registry
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.managers.tokenizer_manager import TokenizerManager
    from sglang.srt.plugins.hook_registry import HookRegistry

    monkeypatch.setattr(Scheduler, "__init__", Scheduler.__init__)
    monkeypatch.setattr(Scheduler, "handle_generate_request", Scheduler.handle_generate_request)
    monkeypatch.setattr(TokenizerManager, "generate_request", TokenizerManager.generate_request)
    monkeypatch.setattr(
        http_server, "_setup_and_run_http_server", http_server._setup_and_run_http_server
    )
    monkeypatch.setattr(HookRegistry, "_hooks", defaultdict(list))
    monkeypatch.setattr(HookRegistry, "_patched", set())
    monkeypatch.setattr(registry, "_RADIX_CACHE_REGISTRY", dict(registry._RADIX_CACHE_REGISTRY))
    return Scheduler, HookRegistry


@pytest.fixture()
def gloo_world(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_sglang_plugin_loaded_by_sglang_and_rpc_dispatch(
    engine: Engine, scheduler, isolated_hooks, gloo_world
) -> None:
    from sglang.srt.managers.io_struct import RpcReqInput, msgpack_decode, msgpack_encode
    from sglang.srt.mem_cache.radix_cache import RadixCache
    from sglang.srt.mem_cache.registry import TreeCacheBuildContext, get_radix_cache_factory
    from sglang.srt.plugins import GENERAL_PLUGINS_GROUP, load_plugins_by_group
    from sglang.srt.plugins.hook_registry import HookType

    Scheduler, HookRegistry = isolated_hooks
    plugins = load_plugins_by_group(GENERAL_PLUGINS_GROUP)
    assert "leyline" in plugins, "entry point not installed (pip install -e .)"
    register, _dist = plugins["leyline"]
    register()
    target = "sglang.srt.managers.scheduler.Scheduler.__init__"
    assert (HookType.AFTER, hook.after_scheduler_init) in [
        (t, h) for t, h, _ in HookRegistry._hooks[target]
    ]
    assert "sglang.srt.entrypoints.http_server._setup_and_run_http_server" in HookRegistry._hooks
    rpc_target = "sglang.srt.managers.scheduler.Scheduler.handle_rpc_request"
    assert (HookType.AROUND, hook.around_rpc_request) in [
        (t, h) for t, h, _ in HookRegistry._hooks[rpc_target]
    ]
    original = Scheduler.__init__
    HookRegistry.apply_hooks()
    assert Scheduler.__init__.__wrapped__ is original

    fake, cache = scheduler
    factory = get_radix_cache_factory("leyline")
    ctx = TreeCacheBuildContext(
        server_args=None, params=_params(cache), is_hybrid_swa=False,
        is_hybrid_ssm=False, enable_hierarchical_cache=False, disable_radix_cache=False,
        tp_worker=None, model_config=None, tp_size=1, tp_rank=0, tp_group=None,
    )  # fmt: skip
    assert type(factory(ctx)) is RadixCache
    with pytest.raises(RuntimeUnavailableError, match="hierarchical"):
        factory(TreeCacheBuildContext(**{**ctx.__dict__, "enable_hierarchical_cache": True}))

    tokens = engine.render(MESSAGES)
    repl = engine.tokenizer.encode("[ok]", add_special_tokens=False)
    sp.prefill(cache, engine.model, tokens)
    sp.prefill(cache, engine.model, tokens[:12] + repl)
    kw = hook.encode_splice_kwargs(tokens, Directive(start=12, end=20, replacement=repl))
    wire = msgpack_decode(msgpack_encode(RpcReqInput(method=hook.RPC_METHOD, parameters=kw)))
    out = Scheduler.handle_rpc_request(fake, wire)
    assert out.success, out.message
    new_tokens = tokens[:12] + repl + tokens[20:]
    assert peek_prefix(cache.tree, new_tokens, ANON).length == len(new_tokens)

    # leyline_lookup's answer rides back in the successful reply (the AROUND hook); other
    # RPCs' replies keep SGLang's empty message
    assert out.message == ""
    for ns, want in ((ANON, len(new_tokens)), (Namespace(session="b").key, 12 + len(repl))):
        lookup = RpcReqInput(
            method=hook.RPC_LOOKUP, parameters=hook.encode_lookup_kwargs(new_tokens, ns)
        )
        out = Scheduler.handle_rpc_request(fake, msgpack_decode(msgpack_encode(lookup)))
        assert out.success and json.loads(out.message) == {"cached_tokens": want}
        assert getattr(fake, hook.ANSWER_ATTR) is None
    bad_ns = {**hook.encode_lookup_kwargs(new_tokens), "namespace": 7}
    out = Scheduler.handle_rpc_request(fake, RpcReqInput(method=hook.RPC_LOOKUP, parameters=bad_ns))
    assert not out.success and isinstance(hook.error_from_message(out.message), DirectiveError)

    bad = {**kw, "end": len(tokens) + 5}
    wire = msgpack_decode(msgpack_encode(RpcReqInput(method=hook.RPC_METHOD, parameters=bad)))
    out = Scheduler.handle_rpc_request(fake, wire)
    assert not out.success
    err = hook.error_from_message(out.message)
    assert isinstance(err, DirectiveError) and "outside the sequence" in str(err)

    # the scheduler's request hook: once the anonymous session holds rows of its own (T'),
    # its requests go to its tree; another session's requests go to the plain tree
    seen = []
    fake._handle_generate_request = lambda req, *a, **k: seen.append(req.extra_key)
    b_key = Namespace(session="b").key
    for ids, key in ((new_tokens + [5], None), (new_tokens, b_key), (tokens, None)):
        req = SimpleNamespace(input_ids=ids, extra_key=key, cache_salt=None, mm_inputs=None)
        Scheduler.handle_generate_request(fake, req)
    assert seen == [ANON, None, ANON]
    sp.evict_all(cache)
    assert cache.allocator.available_size() == cache.initial_free


def test_sglang_session_header_hook(isolated_hooks) -> None:
    """``X-Leyline-Session`` on any generate route -> the request's extra key (SGLang answers
    a ``ValueError`` with 400)."""
    from sglang.srt.managers.io_struct import GenerateReqInput
    from sglang.srt.managers.tokenizer_manager import TokenizerManager
    from sglang.srt.plugins import GENERAL_PLUGINS_GROUP, load_plugins_by_group
    from starlette.requests import Request

    _Scheduler, HookRegistry = isolated_hooks
    load_plugins_by_group(GENERAL_PLUGINS_GROUP)["leyline"][0]()
    HookRegistry.apply_hooks()

    def call(headers: dict[str, str], **fields) -> GenerateReqInput:
        scope = {
            "type": "http",
            "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
        }
        obj = GenerateReqInput(input_ids=[1, 2, 3], **fields)
        # the hook runs at the call; the (never started) async generator is just dropped
        TokenizerManager.generate_request(SimpleNamespace(), obj, Request(scope))
        return obj

    assert call({"X-Leyline-Session": "agent-7"}).extra_key == Namespace(session="agent-7").key
    assert call({}).extra_key is None
    assert call({}, extra_key="mine").extra_key == "mine"  # no header: left alone
    with pytest.raises(ValueError, match="extra_key: cannot be combined"):
        call({"X-Leyline-Session": "agent-7"}, extra_key="mine")
    with pytest.raises(ValueError, match="cache_salt"):
        call({"X-Leyline-Session": "agent-7"}, cache_salt="salt")
    with pytest.raises(ValueError, match="X-Leyline-Session"):
        call({"X-Leyline-Session": "x" * 300})


def _params(cache: sp.SGLangCache):
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams

    return CacheInitParams(
        disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=cache.allocator,
        page_size=1,
    )  # fmt: skip
