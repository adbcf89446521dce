"""Directive sizes over real HTTP: a replacement, or the sequence a splice would produce,
longer than ``--max-prompt-tokens`` is a 400 naming the field before any prefill, and the
cache is unchanged (the next completion of T is still served from cache, no splice counted).
"""

from __future__ import annotations

import time

import httpx
import pytest

from leyline_agent.testing.server import serve_in_thread
from leyline_agent.testing.token_ids import random_ids

pytestmark = pytest.mark.timing  # every refusal is bounded to 1 s

LIMIT = 2000


@pytest.fixture(scope="module")
def served(model_dir):
    from leyline_agent.engine.engine import Engine
    from leyline_agent.server.app import create_app
    from leyline_agent.server.worker import Worker

    worker = Worker(Engine.from_pretrained(model_dir), queue_timeout_s=None)
    app = create_app(worker, max_prompt_tokens=LIMIT)
    with serve_in_thread(app) as srv:
        with httpx.Client(base_url=srv.url, timeout=120) as c:
            yield c, model_dir.name
    worker.close(cancel_pending=True)


def _cache(c: httpx.Client, name: str, tokens: list[int]) -> int:
    r = c.post("/v1/completions", json={"model": name, "prompt": tokens, "max_tokens": 1})
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def _refused(c: httpx.Client, name: str, body: dict, field: str, t: list[int]) -> None:
    before = c.get("/leyline/v1/stats").json()
    t0 = time.monotonic()
    r = c.post("/leyline/v1/directives", json={"model": name, **body})
    took = time.monotonic() - t0
    assert r.status_code == 400, r.text
    assert r.json()["error"]["field"] == field, r.text
    assert took < 1.0, took
    after = c.get("/leyline/v1/stats").json()
    assert after["splices"] == before["splices"]
    assert after["prefilled_tokens"] == before["prefilled_tokens"]  # no R was prefilled
    assert _cache(c, name, t) >= len(t) - 1  # T is still cached as it was


def test_oversized_replacements_and_results_are_refused_fast(served):
    c, name = served
    t = random_ids(1, 100)
    _cache(c, name, t)
    huge = random_ids(2, 60_000)
    _refused(c, name, {"tokens": t, "directives": [{"start": 10, "end": 20, "replacement": huge}]},
             "directives[0].replacement", t)  # fmt: skip
    over = random_ids(3, 3000)  # above the limit, below the model's context
    _refused(c, name, {"tokens": t, "directives": [{"start": 10, "end": 20, "replacement": over}]},
             "directives[0].replacement", t)  # fmt: skip
    text = "lorem ipsum dolor " * 20_000  # ~349 KB of text, refused before it is tokenized
    _refused(c, name, {"tokens": t, "directives": [{"start": 10, "end": 20, "replacement": text}]},
             "directives[0].replacement", t)  # fmt: skip
    # each replacement fits, the spliced sequence does not
    half = random_ids(4, 1000)
    two = [
        {"start": 10, "end": 20, "replacement": half},
        {"start": 30, "end": 40, "replacement": half},
    ]
    _refused(c, name, {"tokens": t, "directives": two}, "directives", t)


def test_a_replacement_within_the_limit_is_spliced(served):
    c, name = served
    t = random_ids(5, 100)
    _cache(c, name, t)
    r_ids = random_ids(6, 300)
    r = c.post("/leyline/v1/directives", json={
        "model": name, "tokens": t, "directives": [{"start": 10, "end": 20, "replacement": r_ids}]})  # fmt: skip
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == t[:10] + r_ids + t[20:]
