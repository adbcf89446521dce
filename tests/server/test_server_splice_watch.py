"""A session is told whenever its splice result is lost before its next request, pinned or not.

The pin on a splice result ends with the session's next request; the rows the splice wrote
stay the session's context. Over HTTP against a real ``leyline serve`` (in a thread) with a
small cache: splice, let one request use the result (the pin is consumed, or there is no
pin at all with ``pin_ttl_s=0``), flood the cache from another session, and the session's
next request must report ``usage.leyline.splice_evicted`` (once) and be served by a
re-prefill (fewer cached tokens than the splice result). Without the flood it reports
nothing and reads the spliced rows from the cache.
"""

from __future__ import annotations

import random

import httpx
import pytest

from leyline_agent.namespaces import SESSION_HEADER
from leyline_agent.testing.server import serve_in_thread


def _ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1900) for _ in range(n)]


def _complete(http: httpx.Client, name: str, prompt: list[int], session: str) -> dict:
    r = http.post(
        "/v1/completions",
        json={"model": name, "prompt": prompt, "max_tokens": 1, "temperature": 0},
        headers={SESSION_HEADER: session},
    )
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def _splice(http: httpx.Client, tokens: list[int]) -> list[int]:
    body = {"tokens": tokens, "directives": [
        {"start": 5, "end": 8, "replacement": [1901], "mode": "amortize"}]}  # fmt: skip
    r = http.post("/leyline/v1/directives", json=body, headers={SESSION_HEADER: "A"})
    assert r.status_code == 200, r.text
    assert r.json()["splices"]["amortize"] == 1
    return r.json()["tokens"]


@pytest.mark.parametrize("flood", [True, False])
@pytest.mark.parametrize("pin_ttl_s", [300.0, 0.0])
def test_a_splice_result_lost_after_its_pin_is_reported(model_dir, pin_ttl_s, flood):
    from leyline_agent.engine.engine import Engine

    engine = Engine.from_pretrained(model_dir, cache_budget_tokens=96, pin_ttl_s=pin_ttl_s)
    T = _ids(30, 30)
    with serve_in_thread(engine) as srv, httpx.Client(base_url=srv.url, timeout=60) as http:
        name = model_dir.name
        _complete(http, name, T, "A")
        T1 = _splice(http, T)
        used = _complete(http, name, T1 + [14], "A")  # the pin (if any) ends here
        if flood:
            for k in range(3):
                _complete(http, name, _ids(40 + k, 60), "B")  # each fills most of the budget
        nxt = _complete(http, name, T1 + [14, 15], "A")
        again = _complete(http, name, T1 + [14, 15, 16], "A")
        evicted = http.get("/leyline/v1/stats", headers={SESSION_HEADER: "B"}).json()
    assert used["leyline"]["splice_evicted"] is False
    assert used["prompt_tokens_details"]["cached_tokens"] == len(T1)
    if flood:
        assert evicted["evicted_tokens"] >= len(T1)  # there really was pressure
        assert nxt["leyline"]["splice_evicted"] is True
        assert nxt["prompt_tokens_details"]["cached_tokens"] < len(T1)
    else:
        assert nxt["leyline"]["splice_evicted"] is False
        assert nxt["prompt_tokens_details"]["cached_tokens"] >= len(T1)
    assert again["leyline"]["splice_evicted"] is False  # told once
