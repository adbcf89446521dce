"""``PrefixCache.flush(tenant)`` and ``POST /leyline/v1/flush``: only the caller's tenant
is emptied, rows a request holds stay, no slot leaks (``PrefixCache.check``), the next
request of the flushed tenant is prefilled from scratch while the other tenant's is not, and
memory freed before the flush leaves the resident size (read from ``/proc``)."""

from __future__ import annotations

import platform
import threading
from pathlib import Path

import httpx
import pytest

from leyline_agent.engine.cache.allocator import SlotAllocator
from leyline_agent.engine.cache.prefix_cache import PrefixCache
from leyline_agent.engine.checkpoints.store import tiny_model_dir
from leyline_agent.engine.engine import Engine
from leyline_agent.namespaces import Namespace
from leyline_agent.testing.server import serve_in_thread


def _cache(n: int = 64) -> PrefixCache:
    return PrefixCache(SlotAllocator(n), budget_tokens=n)


def _put(cache: PrefixCache, tokens: list[int], ns: Namespace, exact_len: int) -> list[int]:
    m = cache.match(tokens, ns)
    fresh = cache.allocator.alloc(len(tokens) - m.length)
    cache.insert(tokens, m.slots + fresh, fresh, ns, exact_len)
    return fresh


def test_flush_frees_only_the_tenants_unlocked_rows() -> None:
    cache = _cache()
    a, a_sess, b = Namespace("a", None), Namespace("a", "s1"), Namespace("b", None)
    _put(cache, [1, 2, 3, 4], a, 4)
    _put(cache, [1, 2, 3, 4, 5, 6], a_sess, 4)  # spliced rows of a's session on a's exact ones
    _put(cache, [1, 2, 7, 8], a, 4)
    _put(cache, [1, 2, 3, 9], b, 4)  # same tokens, other tenant: its own rows
    held = cache.match([1, 2, 7, 8], a)
    cache.hold(held)  # a request in flight reads [1, 2, 7, 8]
    cache.pin(a_sess, [1, 2, 3, 4, 5, 6])
    assert cache.pins.pinned_tokens_of("a") == 6
    used_before = cache.allocator.num_used
    assert cache.tenant_tokens("a") == 8 and cache.tenant_tokens("b") == 4

    rep = cache.flush("a")

    assert (rep.flushed_tokens, rep.kept_tokens, rep.dropped_pins) == (4, 4, 1)
    assert cache.tenant_tokens("a") == 4  # only the held path is left
    assert cache.match([1, 2, 7, 8], a).length == 4
    assert cache.match([1, 2, 3, 4], a).length == 2  # [1, 2] is on the held path
    assert cache.match([1, 2, 3, 4, 5, 6], a_sess).length == 2
    assert cache.match([1, 2, 3, 9], b).length == 4  # b untouched
    assert cache.pins.pinned_tokens_of("a") == 0
    assert cache.allocator.num_used == used_before - 4
    assert cache.total_tokens == 8
    cache.check()

    cache.release(held)
    rep = cache.flush("a")
    assert (rep.flushed_tokens, rep.kept_tokens) == (4, 0)
    assert cache.tenant_tokens("a") == 0 and cache.match([1, 2, 7, 8], a).length == 0
    assert cache.tenant_tokens("b") == 4 == cache.total_tokens == cache.allocator.num_used
    cache.check()
    assert cache.flush("nobody").flushed_tokens == 0
    cache.check()


def test_flush_with_a_locked_detached_branch_leaks_nothing() -> None:
    cache = _cache()
    s = Namespace("a", "s")
    _put(cache, [1, 2, 3, 4], s, 2)
    held = cache.match([1, 2, 3, 4], s)
    cache.hold(held)
    m = cache.match([1, 2], s)  # a new splice result for the same tokens supersedes it
    fresh = cache.allocator.alloc(2)
    cache.insert([1, 2, 3, 4], m.slots + fresh, fresh, s, 2)
    assert cache.tree.detached_slots  # the old branch waits in the graveyard
    cache.flush("a")
    cache.check()
    cache.release(held)
    cache.flush("a")
    assert cache.total_tokens == 0 == cache.allocator.num_used
    cache.check()


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine.from_pretrained(tiny_model_dir("llama"))


def test_flush_route_flushes_the_callers_tenant_only(engine: Engine) -> None:
    keys = [("key-a", "a"), ("key-b", "b")]
    prompt = {"model": engine.model_name, "prompt": list(range(10, 90)), "max_tokens": 1}
    with serve_in_thread(engine, api_keys=keys) as srv:

        def call(
            key: str | None, method: str, path: str, body: dict | None = None
        ) -> httpx.Response:
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            return httpx.request(method, srv.url + path, json=body, headers=headers, timeout=60)

        def cached(key: str) -> int:
            r = call(key, "POST", "/v1/completions", prompt)
            assert r.status_code == 200, r.text
            return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

        assert cached("key-a") == 0 and cached("key-b") == 0
        assert cached("key-a") == 79 and cached("key-b") == 79  # all but the last token
        before_a = call("key-a", "GET", "/leyline/v1/stats").json()
        assert before_a["cache_tokens"] > 0

        assert call(None, "POST", "/leyline/v1/flush").status_code == 401
        assert call("wrong", "POST", "/leyline/v1/flush").status_code == 401
        r = call("key-a", "POST", "/leyline/v1/flush")
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["tenant"] == "a" and body["kept_tokens"] == 0
        assert body["flushed_tokens"] == before_a["cache_tokens"]
        after_a = call("key-a", "GET", "/leyline/v1/stats").json()
        assert after_a["cache_tokens"] == 0
        assert after_a["requests"] == before_a["requests"]  # counters are not reset
        assert call("key-b", "GET", "/leyline/v1/stats").json()["cache_tokens"] > 0
        engine.cache.check()

        assert cached("key-b") == 79  # b kept its rows
        assert cached("key-a") == 0  # a starts from an empty cache
        assert cached("key-a") == 79
        engine.cache.check()


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def _free_in_a_thread(mb: int) -> list[bytes]:
    """Allocate ``mb`` MB in 32 KB blocks on a fresh thread (its own glibc arena), free all but
    the last block: the freed pages stay resident until something trims the arena."""
    kept: list[bytes] = []

    def churn() -> None:
        blocks = [b"x" * 32768 for _ in range(mb * 32)]
        kept.append(blocks[-1])  # the arena's top stays in use: free() alone cannot shrink it
        del blocks

    t = threading.Thread(target=churn)
    t.start()
    t.join()
    return kept


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_flush_route_gives_freed_memory_back(engine: Engine) -> None:
    with serve_in_thread(engine, api_keys=[("key-a", "a")]) as srv:
        base = _rss_mb()
        kept = _free_in_a_thread(256)
        held = _rss_mb()
        assert held - base > 200, (base, held)  # the freed blocks are still resident
        r = httpx.post(srv.url + "/leyline/v1/flush", headers={"Authorization": "Bearer key-a"},
                       timeout=60)  # fmt: skip
        assert r.status_code == 200, r.text
        after = _rss_mb()
        assert held - after > 200, (base, held, after)
        assert kept
