"""Provenance attacks, over HTTP against a real ``leyline serve`` (in a thread).

Ground truth never comes from the server: a fresh prefill is a plain transformers forward
of the whole sequence; an AMORTIZE state is ``RefState`` (the model's own modules).

1. FORGET after a coinciding AMORTIZE equals a fresh prefill.
2. Two sessions whose edits give identical ``T'`` tokens from different histories each get
   their own ground truth; a session-less request gets a fresh prefill's answer.
3. Cache poisoning: caching system + EVIL + the victim's message and deleting EVIL does
   not change what a victim (no session, or another session) is served.
4. 16 concurrent sessions x 20 turns that stub their own old parts with the same
   placeholder (identical ``T'`` tokens across sessions) each equal their solo run.
"""

from __future__ import annotations

import random
import threading

import httpx
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from leyline_agent.engine.checkpoints.store import tiny_model_dir
from leyline_agent.namespaces import SESSION_HEADER
from leyline_agent.reference.kv_reference import RefState, logits_from_kv
from leyline_agent.testing.server import serve_in_thread
from leyline_agent.testing.threads import run_together

pytestmark = pytest.mark.slow

ARCH = "deepseek_v2"


@pytest.fixture(scope="module")
def model_dir():
    return tiny_model_dir(ARCH)


@pytest.fixture(scope="module")
def hf(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _serve(model_dir, **kw):
    from leyline_agent.engine.engine import Engine

    return serve_in_thread(Engine.from_pretrained(model_dir, **kw))


def _headers(session: str | None) -> dict[str, str]:
    return {SESSION_HEADER: session} if session else {}


def complete(http: httpx.Client, name: str, prompt: list[int], session: str | None = None):
    """Top-1 logprob of the greedy next token, its id, and the cached token count."""
    r = http.post(
        "/v1/completions",
        json={"model": name, "prompt": prompt, "max_tokens": 1, "temperature": 0, "logprobs": 1},
        headers=_headers(session),
    )
    assert r.status_code == 200, r.text
    body = r.json()
    lp = body["choices"][0]["logprobs"]["token_logprobs"][0]
    return lp, body["usage"]["prompt_tokens_details"]["cached_tokens"]


def directive(http, tokens, start, end, repl, mode, session=None) -> list[int]:
    body = {
        "tokens": tokens,
        "directives": [{"start": start, "end": end, "replacement": repl, "mode": mode}],
    }
    r = http.post("/leyline/v1/directives", json=body, headers=_headers(session))
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def fresh_logprob(hf, seq: list[int]) -> float:
    with torch.inference_mode():
        logits = hf(input_ids=torch.tensor([seq])).logits[0, -1].float()
    return float(torch.log_softmax(logits, -1).max())


def state_logprob(hf, state: RefState, q: list[int]) -> float:
    logits = logits_from_kv(hf, state.kv(), q)
    return float(torch.log_softmax(logits, -1).max())


def ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1900) for _ in range(n)]


@pytest.mark.parametrize("session", [None, "s-forget"])
def test_forget_after_coinciding_amortize_is_a_fresh_prefill(model_dir, hf, session):
    T = ids(1, 40)
    with _serve(model_dir) as srv, httpx.Client(base_url=srv.url, timeout=60) as http:
        name = model_dir.name
        complete(http, name, T + [7], session)
        T1 = directive(http, T + [7], 10, 20, [5, 6], "amortize", session)
        q = [8]
        lp_amortized, cached = complete(http, name, T1 + q, session)
        assert cached == len(T1)  # the session is served its spliced rows
        want_amortized = state_logprob(
            hf, RefState.prefill(hf, T + [7]).amortize(10, 20, [5, 6]), q
        )
        assert lp_amortized == pytest.approx(want_amortized, abs=1e-4)
        T2 = directive(http, T1 + q, 10, 12, [5, 6], "forget", session)
        assert T2 == T1 + q
        lp, _ = complete(http, name, T2 + [9], session)
    assert lp == pytest.approx(fresh_logprob(hf, T2 + [9]), abs=1e-4)
    assert abs(lp_amortized - fresh_logprob(hf, T1 + q)) > 1e-3  # the two truths differ


def test_sessions_with_identical_edits_get_their_own_truth(model_dir, hf):
    system, msg = ids(2, 12), ids(3, 16)
    X, Y = ids(4, 10), ids(5, 10)
    TA, TB = system + X + msg, system + Y + msg
    s, e = len(system), len(system) + 10
    q = [11, 12]
    with _serve(model_dir) as srv, httpx.Client(base_url=srv.url, timeout=60) as http:
        name = model_dir.name
        complete(http, name, TA, "A")
        complete(http, name, TB, "B")
        TA1 = directive(http, TA, s, e, [1901], "amortize", "A")
        TB1 = directive(http, TB, s, e, [1901], "amortize", "B")
        assert TA1 == TB1  # identical tokens, different histories
        lp_a, _ = complete(http, name, TA1 + q, "A")
        lp_b, _ = complete(http, name, TB1 + q, "B")
        lp_c, cached_c = complete(http, name, TA1 + q, "C")
        lp_none, _ = complete(http, name, TA1 + q)  # C's exact rows may serve it
    want_a = state_logprob(hf, RefState.prefill(hf, TA).amortize(s, e, [1901]), q)
    want_b = state_logprob(hf, RefState.prefill(hf, TB).amortize(s, e, [1901]), q)
    fresh = fresh_logprob(hf, TA1 + q)
    assert lp_a == pytest.approx(want_a, abs=1e-4)
    assert lp_b == pytest.approx(want_b, abs=1e-4)
    assert lp_none == pytest.approx(fresh, abs=1e-4) and lp_c == pytest.approx(fresh, abs=1e-4)
    assert cached_c <= s + 1  # only the exact prefix is shared
    assert min(abs(want_a - want_b), abs(want_a - fresh)) > 1e-4  # the truths really differ


@pytest.mark.parametrize("attacker", [None, "evil"])
def test_cache_poisoning_does_not_reach_a_victim(model_dir, hf, attacker):
    system, evil, victim = ids(6, 12), ids(7, 14), ids(8, 20)
    q = [13]
    with _serve(model_dir) as srv, httpx.Client(base_url=srv.url, timeout=60) as http:
        name = model_dir.name
        T = system + evil + victim
        complete(http, name, T, attacker)
        T1 = directive(http, T, len(system), len(system) + len(evil), [], "amortize", attacker)
        assert T1 == system + victim
        victim_session = "victim" if attacker is None else None
        lp, cached = complete(http, name, system + victim + q, victim_session)
    assert cached <= len(system)  # 52 of 53 tokens were served from the poisoned rows before
    assert lp == pytest.approx(fresh_logprob(hf, system + victim + q), abs=1e-4)


SESSIONS, TURNS = 16, 20
SYSTEM = ids(9, 10)
STUB = [1901, 1902]


def run_session(s: int, base: str, name: str, start: threading.Barrier | None = None):
    """A session of TURNS turns: each turn appends a tool output and asks for 2 tokens;
    every 4th turn it stubs its outputs older than 2 turns with STUB. Every session sees
    the same outputs except its first, so once that is stubbed all sessions hold the same
    ``T'`` tokens, each with its own history in the KV."""
    own, rng = random.Random(s), random.Random(123)
    seq = SYSTEM + [rng.randrange(3, 1900) for _ in range(4)]
    outputs: list[tuple[int, int]] = []  # (start, end) of each tool output in seq
    lps: list[list[float]] = []
    with httpx.Client(base_url=base, timeout=300, headers={SESSION_HEADER: f"s{s}"}) as http:
        if start is not None:
            start.wait()
        for turn in range(TURNS):
            src = own if turn == 0 else rng
            out = [src.randrange(3, 1900) for _ in range(src.randrange(3, 7))]
            outputs.append((len(seq), len(seq) + len(out)))
            seq = seq + out
            r = http.post(
                "/v1/completions",
                json={"model": name, "prompt": seq, "max_tokens": 2, "temperature": 0,
                      "logprobs": 1},
            )  # fmt: skip
            r.raise_for_status()
            lps.append(r.json()["choices"][0]["logprobs"]["token_logprobs"])
            if turn % 4 == 3:
                old = [(a, b) for a, b in outputs[:-2] if seq[a:b] != STUB]
                if old:
                    body = {
                        "tokens": seq,
                        "directives": [
                            {"start": a, "end": b, "replacement": STUB, "mode": "amortize"}
                            for a, b in old
                        ],
                    }
                    d = http.post("/leyline/v1/directives", json=body)
                    d.raise_for_status()
                    shift, fixed = 0, []
                    for a, b in outputs:  # positions after the stubs move
                        na = a + shift
                        if (a, b) in old:
                            shift += len(STUB) - (b - a)
                            fixed.append((na, na + len(STUB)))
                        else:
                            fixed.append((na, na + (b - a)))
                    outputs, seq = fixed, d.json()["tokens"]
    return lps


def test_sixteen_sessions_twenty_turns_identical_stubs_equal_their_solo_runs(model_dir):
    name = model_dir.name
    alone = []
    for s in range(SESSIONS):  # each alone on a fresh server
        with _serve(model_dir) as srv:
            alone.append(run_session(s, srv.url, name))
    with _serve(model_dir) as srv2:
        together = run_together(SESSIONS, lambda s, start: run_session(s, srv2.url, name, start))
        stats = httpx.get(f"{srv2.url}/leyline/v1/stats").json()
    assert stats["splices"]["amortize"] >= SESSIONS * 3
    # after the first stub all sessions hold the same tokens; their answers still differ
    # (each keeps its own history), so contamination would show
    firsts = [round(x[4][0], 3) for x in alone]
    assert len(set(firsts)) > SESSIONS // 2, firsts
    for s in range(SESSIONS):
        for a, b in zip(alone[s], together[s], strict=True):
            np.testing.assert_allclose(b, a, atol=1e-4, err_msg=f"session {s}")


def test_a_splice_result_lost_to_eviction_is_reported_to_its_session(model_dir):
    """PIN holds at most half the budget: a splice result larger than that can be evicted
    by other traffic, and then the session's next response says so (and stats count it)."""
    T, q = ids(10, 50), [14]
    with (
        _serve(model_dir, cache_budget_tokens=64) as srv,
        httpx.Client(base_url=srv.url, timeout=60) as http,
    ):
        name = model_dir.name
        complete(http, name, T, "A")
        T1 = directive(http, T, 5, 8, [1901], "amortize", "A")
        complete(http, name, ids(11, 60), "B")  # pushes T1 out
        r = http.post(
            "/v1/completions",
            json={"model": name, "prompt": T1 + q, "max_tokens": 1},
            headers=_headers("A"),
        )
        usage = r.json()["usage"]
        stats = http.get("/leyline/v1/stats").json()
        again = http.post(
            "/v1/completions",
            json={"model": name, "prompt": T1 + q + [15], "max_tokens": 1},
            headers=_headers("A"),
        ).json()["usage"]
    assert usage["leyline"]["splice_evicted"] is True
    assert usage["prompt_tokens_details"]["cached_tokens"] < len(T1)
    assert stats["pin_evictions"] == 1
    assert again["leyline"]["splice_evicted"] is False  # told once


def test_a_pinned_splice_result_survives_other_traffic(model_dir):
    T, q = ids(12, 30), [16]
    with (
        _serve(model_dir, cache_budget_tokens=96) as srv,
        httpx.Client(base_url=srv.url, timeout=60) as http,
    ):
        name = model_dir.name
        complete(http, name, T, "A")
        T1 = directive(http, T, 5, 8, [1901], "amortize", "A")
        for k in range(3):
            complete(http, name, ids(20 + k, 60), "B")  # each alone fills most of the budget
        _, cached = complete(http, name, T1 + q, "A")
        stats = http.get("/leyline/v1/stats").json()
    assert cached == len(T1) and stats["pin_evictions"] == 0
    assert stats["evicted_tokens"] >= 60  # there really was pressure
