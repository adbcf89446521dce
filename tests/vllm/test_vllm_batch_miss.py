"""A batch directive whose span the batch's earlier splices would leave uncached, on the vLLM
route over HTTP (``http.directive_routes``, the plugin's ``VLLMRoute``), against an EngineCore
written here: a block-granular cache per salt that records every op it is sent.

A vLLM whose rows past a last full block are not held (another KV connector configured:
``DescribeAnswer.held_rows`` false) keeps a splice's ``T'`` through its last full block only.
The directive to the left then finds its span uncached: the batch is refused before the
first write (409 naming it, or with ``fallback`` the ``fallback`` answer), counted as any
miss, and the EngineCore is sent no write (no splice, no forget, no request): its cache is
as it was. With held rows (the plugin's own connector, the default) the same batch runs.
No server is started: the route's ops are answered in process.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from leyline_agent.directives import engine_rpc as ops
from leyline_agent.namespaces import ANONYMOUS
from leyline_agent.vllm_plugin.namespace import salt_for
from leyline_agent.vllm_plugin.route import VLLMRoute, add_routes

B = 32
T = list(range(100, 164))  # two full blocks
BATCH = [  # right to left: (40, 60) leaves T' = 44 tokens, one full block; (34, 38) is past it
    {"start": 34, "end": 38, "replacement": [7]},
    {"start": 40, "end": 60, "replacement": []},
]
WRITES = {"splice", "forget", "request"}


class Tokenizer:
    def convert_tokens_to_ids(self, token: str) -> None:
        return None


@dataclass
class Core:
    """The EngineCore's ops on a cache of one token list per salt (full blocks, plus the
    rows past them when ``held_rows``)."""

    held_rows: bool
    cache: dict[str | None, list[int]] = field(default_factory=dict)
    sent: list[str] = field(default_factory=list)
    locks: set[str] = field(default_factory=set)

    def kept(self, tokens: list[int]) -> list[int]:
        return tokens if self.held_rows else tokens[: len(tokens) // B * B]

    def cached(self, tokens: list[int], salt: str | None) -> int:
        have, n = self.cache.get(salt, []), 0
        while n < min(len(have), len(tokens)) and have[n] == tokens[n]:
            n += 1
        return n

    async def call_utility_async(self, name: str, raw: str) -> str:
        op = ops.parse_op(raw)
        self.sent.append(op.op)
        if isinstance(op, ops.DescribeOp):
            out: object = ops.DescribeAnswer(
                block_size=B, held_rows=self.held_rows, max_model_len=4096,
                model_type="llama", vocab_size=1000,
            )  # fmt: skip
        elif isinstance(op, ops.LockOp):
            n = self.cached(list(op.tokens), op.salt)
            lock = f"lock-{len(self.sent)}" if n and op.hold else None
            self.locks |= {lock} - {None}
            out = ops.LockAnswer(lock_id=lock, cached_tokens=n, salt=op.salt)
        elif isinstance(op, ops.ReleaseOp):
            self.locks -= set(op.ids)
            out = ops.ReleaseAnswer(released=len(op.ids))
        elif isinstance(op, ops.SpliceOp):
            t, s, e = list(op.tokens), op.start, op.end
            c = self.cached(t, op.salt)
            self.cache[op.salt] = self.kept(t[:s] + list(op.replacement) + t[e:c])
            self.locks -= {op.lock_id, op.hold_id}
            out = ops.SpliceAnswer(
                cached_tokens=len(self.cache[op.salt]), new_blocks=0, rotated_tokens=c - e,
                repaired_tokens=0, head_cached_tokens=s, elapsed_s=0.0,
            )  # fmt: skip
        elif isinstance(op, ops.StatsOp):
            out = ops.StatsAnswer(
                requests=0, prompt_tokens=0, cached_tokens=0, generated_tokens=0,
                cache_tokens=sum(map(len, self.cache.values())), cache_capacity_tokens=4096,
                held=len(self.locks), held_rows=0, pinned_tokens=0, pin_evictions=0,
            )  # fmt: skip
        else:
            raise AssertionError(f"op not expected here: {op.op}")
        return ops.answer_json(out)  # type: ignore[arg-type]


class Client:
    def __init__(self, core: Core) -> None:
        self.engine_core = core

    def get_tokenizer(self) -> Tokenizer:
        return Tokenizer()


def _served(held_rows: bool) -> tuple[TestClient, Core]:
    core = Core(held_rows)
    core.cache[salt_for(ANONYMOUS)] = list(T)
    route = VLLMRoute(Client(core), ["m"])  # type: ignore[arg-type]

    async def request(ids: list[int], salt: str, hold_id: str | None) -> None:
        core.sent.append("request")  # the head / FORGET request: vLLM's own prefill

    route.transport.prefill = request  # type: ignore[method-assign]
    app = FastAPI()
    add_routes(app)
    app.state.leyline = route
    return TestClient(app), core


@pytest.mark.parametrize("fallback", [False, True])
def test_a_span_the_batch_leaves_uncached_is_refused_before_any_write(fallback):
    http, core = _served(held_rows=False)
    before = {k: list(v) for k, v in core.cache.items()}
    r = http.post("/leyline/v1/directives", json={"tokens": T, "directives": BATCH,
                                                  "fallback": fallback})  # fmt: skip
    want_tokens = T[:34] + [7] + T[38:40] + T[60:]
    if fallback:
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["outcome"] == "fallback" and body["fallback"] and body["tokens"] == want_tokens
    else:
        assert r.status_code == 409, r.text
        err = r.json()["error"]
        assert err["leyline_type"] == "CacheMissError"
        assert "span [34, 38)" in err["message"] and "first 32 tokens" in err["message"]
    assert not WRITES & set(core.sent), core.sent  # nothing written: the cache is as it was
    assert core.cache == before and not core.locks  # and the lookup's hold was given back
    stats = http.get("/leyline/v1/stats").json()
    assert stats["fallbacks"] == int(fallback)
    assert stats["directive_errors"] == int(not fallback)
    assert stats["splices"] == {"amortize": 0, "forget": 0}


def test_with_held_rows_the_same_batch_runs():
    http, core = _served(held_rows=True)
    r = http.post("/leyline/v1/directives", json={"tokens": T, "directives": BATCH})
    assert r.status_code == 200, r.text
    assert r.json()["splices"] == {"amortize": 2, "forget": 0}
    assert core.sent.count("splice") == 2 and core.sent.count("request") == 2
    stats = http.get("/leyline/v1/stats").json()
    assert stats["splices"]["amortize"] == 2 and stats["directive_errors"] == 0
