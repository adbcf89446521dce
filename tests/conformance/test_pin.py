"""PIN of splice results: the same scenario on both live servers, each with a small cache.

``leyline serve`` (``--cache-tokens 1024``) and ``vllm serve`` + the plugin (block 32,
``--num-gpu-blocks-override 33``: 32 usable blocks, 1024 rows), both on the 4-layer llama
``mini``, both behind conftest's ``--api-key``; one pair with pins on (TTL 300 s), then one
with pins off (``--pin-ttl-s 0``, ``LEYLINE_PIN_TTL_S=0``). Session ``A`` caches ``T``
and splices it (AMORTIZE, token form); session ``ref`` splices the same ``T`` and asks
``T' + [x]`` before any flood: the no-flood answer. Then session ``B`` floods the cache
(distinct prompts, each fitting beside the pin, 1600 rows in all) and ``A`` asks
``T' + [x]``:

- with pins, ``pinned_tokens`` > 0 before the flood; ``A`` still reads its spliced rows
  (all of ``T'`` but at most its last partial block: vLLM pins full blocks) and answers
  what ``ref`` answered (1e-4), no ``splice_evicted``; ``T``'s own rows past the span's
  block (unpinned) are gone; no ``pin_evictions``;
- without pins the same flood takes ``A``'s rows: its next answer says
  ``usage.leyline.splice_evicted: true`` once (the one after it does not), it reads fewer
  rows and does not answer what ``ref`` answered.

``vllm serve`` puts ``splice_evicted`` in the usage only when true; ``leyline serve``
always has the key: both are read with ``.get("splice_evicted", False)``.
``LEYLINE_CONFORMANCE_PIN_TTL_S=0`` starts the "pins" pair without pins too: then the first
test must fail on both servers (the check that it can fail).
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from leyline_agent.engine.checkpoints.store import model_dir
from leyline_agent.testing.server import serve_vllm, wait_ready

KEY = "sk-conformance"  # conftest's
TTL = os.environ.get("LEYLINE_CONFORMANCE_PIN_TTL_S", "300")
BLOCK = 32
CACHE = 32 * BLOCK  # rows on each server (vLLM: 33 blocks, one of them its null block)
TOL = 1e-4
T_LEN, SPAN, R = 4 * BLOCK, (20, 30), [11, 12, 13]  # T' = 121 rows: 3 full blocks + 25
T1_LEN = T_LEN - (SPAN[1] - SPAN[0]) + len(R)
FLOOD = [400] * 4  # 1600 rows through 1024, each request fitting beside the pin


def _ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 5990) for _ in range(n)]


@dataclass
class Srv:
    name: str
    url: str
    model: str
    http: httpx.Client

    def post(self, path: str, body: Any, session: str) -> dict[str, Any]:
        r = self.http.post(self.url + path, json=body, headers={"X-Leyline-Session": session})
        assert r.status_code == 200, (self.name, r.text)
        return r.json()

    def complete(self, prompt: list[int], session: str) -> dict[str, Any]:
        """cached_tokens, ``splice_evicted`` (False when absent) and the top-5 logprobs."""
        j = self.post("/v1/completions", {
            "model": self.model, "prompt": prompt, "max_tokens": 1, "temperature": 0,
            "logprobs": 5,
        }, session)  # fmt: skip
        u = j["usage"]
        return {
            "cached": u["prompt_tokens_details"]["cached_tokens"],
            "evicted": u.get("leyline", {}).get("splice_evicted", False),
            "top": j["choices"][0]["logprobs"]["top_logprobs"][0],
        }

    def splice(self, tokens: list[int], session: str) -> list[int]:
        d = {"start": SPAN[0], "end": SPAN[1], "replacement": R, "mode": "amortize"}
        j = self.post("/leyline/v1/directives", {"tokens": tokens, "directives": [d]}, session)
        assert j["outcome"] == "applied" and j["splices"]["amortize"] == 1, (self.name, j)
        return j["tokens"]

    def stats(self) -> dict[str, Any]:
        r = self.http.get(self.url + "/leyline/v1/stats")
        assert r.status_code == 200, (self.name, r.text)
        return r.json()


PAIRS = {"pins": TTL, "no-pins": "0"}


@pytest.fixture(scope="module")
def pair(request, start_leyline) -> Iterator[dict[str, Srv]]:
    """Both servers with the pin TTL named by the (indirect) parameter. Module scope: the
    tests of one pair run together, and a pair stops before the next starts."""
    ttl, ckpt = PAIRS[request.param], model_dir("llama", "mini")
    leyline_process, client = start_leyline  # conftest's
    args = ["--api-key", KEY, "--num-gpu-blocks-override", str(CACHE // BLOCK + 1)]
    with (
        leyline_process(ckpt, "--cache-tokens", str(CACHE), "--pin-ttl-s", ttl,
                        ready=False) as ley,
        serve_vllm(ckpt, block_size=BLOCK, extra_args=args, max_model_len=CACHE,
                   env={"LEYLINE_PIN_TTL_S": ttl}) as v,
        client() as c,
    ):  # fmt: skip
        wait_ready(ley.url, 300, alive=lambda: ley.process.poll() is None)
        yield {"leyline": Srv("leyline", ley.url, ckpt.name, c),
               "vllm": Srv("vllm", v.url, v.model, c)}  # fmt: skip


SERVERS = pytest.mark.parametrize("name", ["leyline", "vllm"])


def _max_diff(a: dict[str, float], b: dict[str, float]) -> float:
    """Largest logprob difference over the top tokens (another top set: infinite)."""
    if a.keys() != b.keys():
        return float("inf")
    return max(abs(a[k] - b[k]) for k in a)


def _scenario(c: Srv, seed: int, flood: list[int]) -> dict[str, Any]:
    """Splice ``T`` in ``ref`` and ``A``; ``ref``'s next request (no flood); the flood
    from ``B``; ``A``'s next two requests; ``T`` from a session that never spliced."""
    t, tag = _ids(seed, T_LEN), f"-{c.name}-{seed}"
    assert c.complete(t, "A" + tag)["cached"] < BLOCK  # T cached now, not before
    new = c.splice(t, "ref" + tag)
    assert len(new) == T1_LEN and c.splice(t, "A" + tag) == new
    nxt = new + [17]
    ref = c.complete(nxt, "ref" + tag)
    assert ref["cached"] >= T1_LEN - BLOCK and not ref["evicted"], (c.name, ref)
    before = c.stats()
    for k, n in enumerate(flood):
        c.complete(_ids(10_000 + 100 * seed + k, n), "B" + tag)
    after = c.complete(nxt, "A" + tag)
    again = c.complete(nxt + [18], "A" + tag)
    plain = c.complete(t + [19], "C" + tag)  # T: its rows past the span's block are unpinned
    return {"ref": ref, "after": after, "again": again, "plain": plain,
            "before": before, "stats": c.stats()}  # fmt: skip


@pytest.mark.parametrize("pair", ["pins"], indirect=True)
@SERVERS
def test_a_pinned_splice_result_survives_a_flood_alike(pair, name):
    r = _scenario(pair[name], 1, FLOOD)
    after = r["after"]
    assert r["before"]["pinned_tokens"] > 0, (name, r["before"])  # A's result is held
    assert after["cached"] >= T1_LEN - BLOCK, (name, after["cached"])
    assert _max_diff(after["top"], r["ref"]["top"]) <= TOL, (name, after, r["ref"])
    assert not after["evicted"] and not r["again"]["evicted"], name
    assert r["plain"]["cached"] <= BLOCK, (name, r["plain"])  # the flood took T's rows
    assert r["stats"]["pin_evictions"] == r["before"]["pin_evictions"], name
    assert r["stats"]["pinned_tokens"] == 0, name  # A's request ended its pin


@pytest.mark.parametrize("pair", ["no-pins"], indirect=True)
@SERVERS
def test_without_pins_the_same_flood_loses_the_result_and_says_so_once_alike(pair, name):
    r = _scenario(pair[name], 1, FLOOD)  # the same T, splice and flood as with pins
    after = r["after"]
    assert r["before"]["pinned_tokens"] == 0, (name, r["before"])
    assert after["evicted"] is True, (name, after)
    assert r["again"]["evicted"] is False, name  # told once
    assert after["cached"] < T1_LEN - BLOCK, (name, after["cached"])
    assert _max_diff(after["top"], r["ref"]["top"]) > TOL, name  # not the spliced answer
