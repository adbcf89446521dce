"""Spliced blocks are their session's (``leyline_agent.namespaces``; on vLLM, the session's
``cache_salt``): the session that made the splice is served from them, over plain HTTP with
the OpenAI client and its ``X-Leyline-Session`` header; another session and a request with
no session get a fresh prefill's answer, never the spliced rows. And bad directives change
nothing: the next request's cached tokens and log-probs are what they were."""

from __future__ import annotations

import openai

from leyline_agent.reference.kv_reference import RefState

TOL = 1e-4


def _openai_next(client: openai.OpenAI, model: str, prompt: list[int], session: str | None):
    kw = {"extra_headers": {"X-Leyline-Session": session}} if session else {}
    r = client.completions.create(
        model=model, prompt=prompt, max_tokens=1, temperature=0, logprobs=20,
        extra_body={"return_tokens_as_token_ids": True}, **kw,
    )  # fmt: skip
    top = r.choices[0].logprobs.top_logprobs[0]
    got = {int(k.removeprefix("token_id:")): v for k, v in top.items()}
    return r.usage.prompt_tokens_details.cached_tokens, got


def test_only_the_splicing_session_is_served_its_spliced_blocks(llama):
    live, b = llama, llama.block
    t, r, x = live.ids(31, 6 * b), live.ids(32, 12), live.ids(33, 1)
    s, e = 50, 100
    live.complete(t)  # exact blocks, shared by token identity
    resp = live.directive(
        {"tokens": t, "directives": [{"start": s, "end": e, "replacement": r}]}, session="agent-a"
    )
    assert resp.status_code == 200, resp.text
    new = t[:s] + r + t[e:]
    full = (len(new) // b) * b  # T''s full blocks; the rows past them are held too
    kept = len(new)
    spliced = live.truth(RefState.prefill(live.model, t).amortize(s, e, r), kept, x)
    fresh = RefState.prefill(live.model, new)
    client = openai.OpenAI(base_url=live.srv.base_url, api_key="-", max_retries=0)

    own_cached, own = _openai_next(client, live.srv.model, new + x, "agent-a")
    assert own_cached == kept and live.max_err(own, spliced) <= TOL

    for session in ("agent-b", None):  # another session, then no session at all
        cached, got = _openai_next(client, live.srv.model, new + x, session)
        if session is not None:  # the first to ask computes T' exactly (shared from then on)
            assert cached < full
        truth = live.truth(fresh, cached, new[cached:] + x)
        assert live.max_err(got, truth) <= TOL, session  # ... a fresh prefill's answer
        assert live.max_err(got, spliced) > 100 * TOL

    # the session still gets its own rows after the others cached T' exactly
    again_cached, again = _openai_next(client, live.srv.model, new + x, "agent-a")
    assert again_cached == kept and live.max_err(again, spliced) <= TOL


def test_a_session_header_next_to_another_cache_salt_is_refused(llama):
    r = llama.client.post(
        llama.url + "/v1/completions",
        json={"model": llama.srv.model, "prompt": [5, 6, 7], "max_tokens": 1, "cache_salt": "mine"},
        headers={"X-Leyline-Session": "agent-a"},
    )
    assert r.status_code == 400 and r.json()["error"]["field"] == "cache_salt"


def test_bad_directives_leave_the_cache_unchanged(llama):
    live, b = llama, llama.block
    t, x = live.ids(41, 5 * b), live.ids(42, 1)
    live.complete(t)
    before = live.complete(t + x)
    errors0 = live.stats()["directive_errors"]
    d = {"start": 40, "end": 70, "replacement": [7, 8]}
    bad = [
        (
            {"tokens": t, "directives": [d, {"start": 60, "end": 80, "replacement": []}]},
            400,
            "directives[1]",
        ),
        ({"tokens": t, "directives": [{**d, "end": 5 * b + 3}]}, 400, "directives[0].end"),
        (
            {"tokens": t, "directives": [{**d, "replacement": [10**6]}]},
            400,
            "directives[0].replacement[0]",
        ),
        ({"tokens": t, "directives": [{**d, "mode": "pin"}]}, 400, "directives[0].mode"),
        ({"tokens": t, "directives": [{**d, "start": "40"}]}, 400, "directives[0].start"),
        ({"tokens": t + [3] * 10**4, "directives": [d]}, 400, "tokens"),
        ({"tokens": live.ids(43, 5 * b), "directives": [d]}, 409, "directives[0]"),  # not cached
        ({"tokens": t, "directives": [d], "model": "another-model"}, 404, "model"),
        ({"tokens": t}, 400, None),
    ]
    for body, status, field in bad:
        r = live.directive(body)
        assert r.status_code == status, (body.get("directives"), r.text)
        err = r.json()["error"]
        assert err["type"] and err["message"]
        if field is not None:
            assert err["field"] == field, err
    r = live.directive(
        {"tokens": t, "directives": [d]}, session="x" * 300
    )  # longer than a session id may be
    assert r.status_code == 400 and r.json()["error"]["leyline_type"] == "RequestError"
    # only the miss reached the cache: a refused body changes no counter (as leyline serve)
    assert live.stats()["directive_errors"] == errors0 + 1
    after = live.complete(t + x)
    assert after[0] == before[0]
    assert after[1].keys() == before[1].keys()
    assert max(abs(after[1][k] - before[1][k]) for k in before[1]) <= 1e-6
