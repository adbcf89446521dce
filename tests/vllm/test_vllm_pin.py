"""PIN of splice results on ``vllm serve`` + the plugin, over HTTP, with a KV cache small
enough (65 blocks of 32 rows) that a flood from another session evicts everything it can.

Each scenario splices the same ``T`` in two sessions: ``ref``'s next request, made before
any flood, is the no-flood answer; then session ``B`` floods the cache and ``A``'s next
request is compared with it. With pins (the default TTL), ``A`` still reads its spliced
rows and answers the same; with ``LEYLINE_PIN_TTL_S=0`` (no pins: the result is only
watched) the same flood takes them, and ``A``'s request says ``splice_evicted`` once. A
flood bigger than the pool's free blocks breaks the pin (oldest first), and is counted. A
stream says it in its usage event.
"""

from __future__ import annotations

import json
import random
from typing import Any

import httpx
import pytest

from leyline_agent.engine.checkpoints.store import tiny_model_dir
from leyline_agent.testing.server import serve_vllm

BLOCK = 32
POOL = ["--num-gpu-blocks-override", "65", "--max-model-len", "2048"]
T_LEN, SPAN = 7 * BLOCK, (40, 50)  # T wholly cached in full blocks
FULL = (T_LEN - (SPAN[1] - SPAN[0]) + 3) // BLOCK * BLOCK  # T' (217 rows): 6 full blocks


def _ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 5990) for _ in range(n)]


class Client:
    def __init__(self, url: str, model: str, http: httpx.Client) -> None:
        self.url, self.model, self.http = url, model, http

    def complete(self, prompt: list[int], session: str) -> dict[str, Any]:
        """usage (with ``leyline`` if the server added it) and the top-5 logprobs."""
        r = self.http.post(
            self.url + "/v1/completions",
            json={"model": self.model, "prompt": prompt, "max_tokens": 1, "temperature": 0,
                  "logprobs": 5, "return_tokens_as_token_ids": True},
            headers={"X-Leyline-Session": session},
        )  # fmt: skip
        assert r.status_code == 200, r.text
        j = r.json()
        return {"usage": j["usage"], "top": j["choices"][0]["logprobs"]["top_logprobs"][0]}

    def splice(self, tokens: list[int], session: str) -> list[int]:
        body = {"tokens": tokens, "directives": [
            {"start": SPAN[0], "end": SPAN[1], "replacement": [11, 12, 13], "mode": "amortize"}]}  # fmt: skip
        r = self.http.post(
            self.url + "/leyline/v1/directives", json=body, headers={"X-Leyline-Session": session}
        )
        assert r.status_code == 200, r.text
        assert r.json()["splices"]["amortize"] == 1
        return r.json()["tokens"]

    def stats(self) -> dict[str, Any]:
        return self.http.get(self.url + "/leyline/v1/stats").json()


def _server(ttl: str):
    d = tiny_model_dir("llama")
    env = {"LEYLINE_PIN_TTL_S": ttl}
    with (
        serve_vllm(d, block_size=BLOCK, extra_args=POOL, max_model_len=2048, env=env) as srv,
        httpx.Client(timeout=300) as http,
    ):
        yield Client(srv.url, srv.model, http)


@pytest.fixture(scope="module")
def pinned():
    yield from _server("300")


@pytest.fixture(scope="module")
def unpinned():
    yield from _server("0")


def _cached(out: dict[str, Any]) -> int:
    return out["usage"]["prompt_tokens_details"]["cached_tokens"]


def _evicted(out: dict[str, Any]) -> bool | None:
    return out["usage"].get("leyline", {}).get("splice_evicted")


def _max_diff(a: dict[str, float], b: dict[str, float]) -> float:
    """Largest logprob difference over the top tokens (another top set: infinite)."""
    if a.keys() != b.keys():
        return float("inf")
    return max(abs(a[k] - b[k]) for k in a)


def _scenario(c: Client, seed: int, flood: list[int]) -> dict[str, Any]:
    """Splice T in ``ref`` and ``A``; ``ref``'s next request (no flood), the flood from
    ``B`` (one request per length in ``flood``), ``A``'s next two requests."""
    t = _ids(seed, T_LEN)
    tag = f"{seed}"
    c.complete(t, "A" + tag)  # T cached (exact rows, no salt)
    new = c.splice(t, "ref" + tag)
    assert c.splice(t, "A" + tag) == new
    nxt = new + [17]
    ref = c.complete(nxt, "ref" + tag)
    assert _cached(ref) >= FULL and not _evicted(ref)
    before = c.stats()
    for k, n in enumerate(flood):
        c.complete(_ids(10_000 + seed * 100 + k, n), "B" + tag)
    after = c.complete(nxt, "A" + tag)
    again = c.complete(nxt + [18], "A" + tag)
    exact = c.complete(nxt, "C" + tag)  # a session that never spliced: a plain prefill
    return {"ref": ref, "after": after, "again": again, "exact": exact,
            "before": before, "stats": c.stats()}  # fmt: skip


FLOOD = [600] * 6  # 114 blocks through a pool of 64, none over the free blocks


def test_a_pinned_splice_result_survives_a_flood(pinned):
    r = _scenario(pinned, 1, FLOOD)
    assert r["before"]["pinned_tokens"] >= FULL  # A's result is held during the flood
    assert _cached(r["after"]) >= FULL
    assert _max_diff(r["after"]["top"], r["ref"]["top"]) < 1e-5  # the no-flood answer
    assert _max_diff(r["exact"]["top"], r["ref"]["top"]) > 1e-4  # a re-prefill differs
    assert not _evicted(r["after"]) and not _evicted(r["again"])
    assert r["stats"]["pin_evictions"] == r["before"]["pin_evictions"]
    assert r["stats"]["pinned_tokens"] == 0  # A's request ended the pin


def test_without_pins_the_flood_evicts_and_the_next_request_is_told_once(unpinned):
    r = _scenario(unpinned, 2, FLOOD)
    assert r["before"]["pinned_tokens"] == 0
    assert _cached(r["after"]) < FULL  # the same flood took A's spliced rows
    assert _evicted(r["after"]) is True
    assert not _evicted(r["again"])  # told once
    assert _max_diff(r["after"]["top"], r["ref"]["top"]) > 1e-4  # the answer changed


def test_a_flood_bigger_than_the_free_pool_breaks_the_pin_and_is_counted(pinned):
    r = _scenario(pinned, 3, [1700])  # 54 blocks: more than the pool has free beside the pin
    assert _cached(r["after"]) < FULL
    assert _evicted(r["after"]) is True
    assert not _evicted(r["again"])
    assert r["stats"]["pin_evictions"] == r["before"]["pin_evictions"] + 1


def test_a_stream_says_it_in_its_usage_event(unpinned):
    c, t = unpinned, _ids(4, T_LEN)
    c.complete(t, "A4")
    new = c.splice(t, "A4")
    for k, n in enumerate(FLOOD):
        c.complete(_ids(20_000 + k, n), "B4")
    r = c.http.post(
        c.url + "/v1/completions",
        json={"model": c.model, "prompt": new + [17], "max_tokens": 3, "temperature": 0,
              "stream": True, "stream_options": {"include_usage": True}},
        headers={"X-Leyline-Session": "A4"},
    )  # fmt: skip
    assert r.status_code == 200, r.text
    events = [json.loads(e[6:]) for e in r.text.split("\n\n") if e.startswith("data: {")]
    with_usage = [e for e in events if e.get("usage")]
    assert len(with_usage) == 1 and len(events) > 1
    assert with_usage[0]["usage"]["leyline"] == {"splice_evicted": True}
    assert all("leyline" not in (e.get("usage") or {}) for e in events if e is not with_usage[0])
