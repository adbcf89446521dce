"""16 agent sessions at once over HTTP: each gets exactly what it gets alone.

Every session shares a system prefix with the others, then has its own turns and
directives (both modes, random spans, growing and shrinking), some turns streamed. The
sessions run once one after another on a fresh server, and once all at once (16 threads
released together) on another fresh server; per session the answers, the directive
results and the cache hits of the later turns must agree, and nothing may fail.
"""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass, field

import httpx
import numpy as np
import openai
import pytest

from leyline_agent.engine.checkpoints.store import tiny_model_dir
from leyline_agent.testing.server import serve_in_thread
from leyline_agent.testing.threads import run_together

pytestmark = pytest.mark.slow

ARCH = "deepseek_v2"
SESSIONS = 16
SHARED = [random.Random(999).randrange(3, 5990) for _ in range(16)]  # one system prefix for all


@dataclass
class Transcript:
    texts: list[str] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)
    cached: list[int] = field(default_factory=list)
    spliced: list[list[int]] = field(default_factory=list)


def run_session(
    s: int, base: str, model: str, start: threading.Barrier | None = None
) -> Transcript:
    rng = random.Random(s)
    own = [rng.randrange(3, 5990) for _ in range(20)]
    client = openai.OpenAI(
        base_url=f"{base}/v1",
        api_key="none",
        max_retries=0,
        timeout=300,
        default_headers={"X-Leyline-Session": f"s{s}"},  # spliced rows are the session's own
    )
    out = Transcript()
    prompt = SHARED + own
    with httpx.Client(base_url=base, timeout=300) as http:
        if start is not None:
            start.wait()
        for turn in range(3):
            stream = turn == 2 and s % 2 == 1
            kw = dict(model=model, prompt=prompt, max_tokens=2, temperature=0, logprobs=1)
            if stream:
                parts = list(
                    client.completions.create(
                        **kw, stream=True, stream_options={"include_usage": True}
                    )
                )
                text = "".join(p.choices[0].text for p in parts if p.choices)
                lps = [
                    x
                    for p in parts
                    if p.choices and p.choices[0].logprobs
                    for x in p.choices[0].logprobs.token_logprobs
                ]
                usage = parts[-1].usage
            else:
                r = client.completions.create(**kw)
                text, lps, usage = r.choices[0].text, r.choices[0].logprobs.token_logprobs, r.usage
            out.texts.append(text)
            out.logprobs.append(lps)
            out.cached.append(usage.prompt_tokens_details.cached_tokens)
            if turn == 2:
                break
            a = rng.randrange(len(SHARED), len(prompt) - 4)  # the shared prefix is never edited
            b = rng.randrange(a, min(a + 8, len(prompt)))
            d = {
                "start": a,
                "end": b,
                "replacement": [rng.randrange(3, 5990) for _ in range(rng.randrange(0, 7))],
                "mode": ("amortize", "forget")[(s + turn) % 2],
            }
            resp = http.post(
                "/leyline/v1/directives",
                json={"tokens": prompt, "directives": [d], "session": f"s{s}"},
            )
            resp.raise_for_status()
            prompt = resp.json()["tokens"]
            out.spliced.append(prompt)
            prompt = prompt + [rng.randrange(3, 5990) for _ in range(3)]
    return out


@pytest.fixture(scope="module")
def model_dir():
    return tiny_model_dir(ARCH)


def _serve(model_dir):
    from leyline_agent.engine.engine import Engine

    return serve_in_thread(Engine.from_pretrained(model_dir))


def test_sixteen_concurrent_sessions_equal_their_runs_alone(model_dir):
    name = model_dir.name
    with _serve(model_dir) as srv:
        alone = [run_session(s, srv.url, name) for s in range(SESSIONS)]

    with _serve(model_dir) as srv2:
        together = run_together(SESSIONS, lambda s, start: run_session(s, srv2.url, name, start))
        stats = httpx.get(f"{srv2.url}/leyline/v1/stats").json()
    assert stats["requests"] == 3 * SESSIONS and stats["directive_errors"] == 0
    assert stats["splices"]["amortize"] + stats["splices"]["forget"] == 2 * SESSIONS

    for s, (a, b) in enumerate(zip(alone, together, strict=True)):
        assert b is not None
        assert b.texts == a.texts, s
        assert b.spliced == a.spliced, s
        for la, lb in zip(a.logprobs, b.logprobs, strict=True):
            np.testing.assert_allclose(lb, la, atol=1e-4, err_msg=f"session {s}")
        # turn 1 may or may not find the shared prefix cached, depending on who came first
        assert {a.cached[0], b.cached[0]} <= {0, len(SHARED)}, s
        assert b.cached[1:] == a.cached[1:], s
        for spliced, cached in zip(a.spliced, a.cached[1:], strict=True):
            assert cached >= len(spliced), s  # the next turn hit T' in the cache
