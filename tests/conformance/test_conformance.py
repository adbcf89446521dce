"""One contract, two live servers: ``leyline serve`` and ``vllm serve`` + the Leyline plugin
get the same requests and must give the same answers (``conftest``: the 4-layer llama
``mini``, vLLM at block 32 and at its default block size 128, both behind ``--api-key``;
the core cases, marked ``CORE``, also against vLLM with tensor parallelism 2 at block 32).

- chains: directive chains of every case type (a first splice anywhere in ``T``, its
  partial last block included; a FORGET after an AMORTIZE starting among the rotated rows;
  a second AMORTIZE inside an earlier splice's tail, in the block that holds rotated rows;
  random mixes; 54 chains per vLLM configuration, 162 in all). After each directive both
  servers keep every row of ``T'`` (the next request's ``cached_tokens`` is ``len(T')`` on both), each server's next-token top-20
  log-probs equal an independent oracle (transformers' own modules and rotary function,
  ``RefState``) within 1e-4, and the two servers equal each other within 1e-4;
- bad input: 60+ bodies, the same 4xx status and the same error body on both, never a 5xx;
- auth: every Leyline route 401 without the key, same body;
- ``request_id``: a retry is the first answer, another body under the id a 400;
- limits: a 40 MB body is a 413, same body;
- the chat front: edits riding in a chat body and a drifted head line are exact splices,
  ``context_management`` and conversations found by content act alike on both.
"""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
import torch

from leyline_agent.reference.kv_reference import RefState, logits_from_kv

TOL = 1e-4
KEY = "sk-conformance"  # conftest's
BLOCK = 32  # the smallest vLLM block size in conftest: the scale of the fixed cases
TOP = 20
# conftest's vLLM configurations (TP1 + TP2): the core cases below run on all three.
CONFIGS = ["block32", "block128", "block32-tp2"]
CORE = pytest.mark.parametrize("vllm_srv", CONFIGS, indirect=True)


def ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 5990) for _ in range(n)]


def truth(model: Any, state: RefState, held: int, rest: list[int]) -> list[float]:
    """The top-20 next-token log-probs (sorted) after ``state``'s first ``held`` rows with
    ``rest`` prefilled over them: fp64 log-softmax of transformers' own logits."""
    head = _keep(model, state, held)
    logits = logits_from_kv(model, head.kv(), rest)
    lp = torch.log_softmax(logits.double(), -1)
    return [float(v) for v in torch.topk(lp, TOP).values]


def _keep(model: Any, state: RefState, n: int) -> RefState:
    return RefState(
        model,
        state.tokens[:n],
        [p[:, :, :n] for p in state.plain],
        [p[:, :, :n] for p in state.pre],
    )


# -- chains --------------------------------------------------------------------------------
KINDS = ["first", "forget_after_amortize", "second_in_tail", "random"]
CHAIN_SEEDS = range(3)  # per fixed kind
RANDOM_SEEDS = range(45)  # random mixes: 9 + 45 = 54 chains per configuration, 162 in all
CHAIN_CASES = [(k, s) for k in KINDS[:3] for s in CHAIN_SEEDS] + [
    ("random", s) for s in RANDOM_SEEDS
]


def _chain(kind: str, seed: int, b: int) -> tuple[list[int], list[dict]]:
    """``T`` (3..6 blocks of ``b`` + a partial one) and one directive per step. The second
    step's span is placed by its kind: inside the first splice's tail, starting at most 26
    rows after the tail's first row and not on a block boundary, so the rows before
    ``start`` in its block include rotated rows the server must keep."""
    rng = random.Random(f"{kind}-{seed}-{b}")
    n = rng.randrange(3 * b, 6 * b) + rng.randrange(1, b)
    t = ids(2000 + 7 * seed + b, n)
    room = 2 if kind == "first" else 40  # rows of T left after the first span
    s = rng.randrange(4, n - room - 8)
    e = s + rng.randrange(1, min(40, n - s - room))
    r = ids(3000 + 10 * seed + b, rng.randrange(0, 24))
    first = {"start": s, "end": e, "replacement": r, "mode": "amortize"}
    if kind == "first":
        return t, [first]
    if kind == "random":
        first["mode"] = rng.choice(["amortize", "amortize", "forget"])
    cur = n - (e - s) + len(r) + 1
    tail = s + len(r)  # first row of the first splice's tail in T'
    if kind == "random":
        s2 = rng.randrange(4, cur - 12)
    else:
        lo = tail + 1 if (tail + 1) % b else tail + 2
        s2 = rng.randrange(lo, min(cur - 4, lo + 24))
        if s2 % b == 0:
            s2 += 1
    e2 = s2 + rng.randrange(1, max(2, min(30, cur - s2 - 2)))
    r2 = ids(5000 + 10 * seed + b, rng.randrange(0, 20))
    mode2 = {"forget_after_amortize": "forget", "second_in_tail": "amortize"}.get(kind)
    mode2 = mode2 or rng.choice(["amortize", "forget"])
    return t, [first, {"start": s2, "end": e2, "replacement": r2, "mode": mode2}]


def _oracle(model: Any, t: list[int], steps: list[dict], seed: int) -> list[list[float]]:
    """Per step, the independent answer: AMORTIZE keeps the prefix, prefills ``R`` over it
    and moves the tail's pre-RoPE keys; FORGET keeps the rows before ``start`` and prefills
    the rest; every row of ``T'`` is kept for the next request (``x``, one token)."""
    state, seq, out = RefState.prefill(model, t), list(t), []
    for k, d in enumerate(steps):
        s, e, r = d["start"], d["end"], d["replacement"]
        new = seq[:s] + r + seq[e:]
        if d["mode"] == "amortize":
            state = state.amortize(s, e, r)
        else:
            state = _keep(model, state, s).extend(new[s:])
        x = ids(4000 + 10 * seed + k, 1)
        out.append(truth(model, state, len(new), x))
        state, seq = state.extend(x), new + x
    return out


def _run_chain(srv, t: list[int], steps: list[dict], session: str, seed: int) -> list[list[float]]:
    """Run the chain on ``srv``; per step the served top-20. Every row of ``T'`` must be
    served from the server's cache (``cached_tokens == len(T')``)."""
    srv.complete(t, session)
    seq, out = list(t), []
    for k, d in enumerate(steps):
        r = srv.directive({"tokens": seq, "directives": [d]}, session)
        assert r.status_code == 200, (srv.name, r.text)
        body = r.json()
        new = seq[: d["start"]] + d["replacement"] + seq[d["end"] :]
        assert body["tokens"] == new and body["outcome"] == "applied", srv.name
        assert body["splices"] == {"amortize": int(d["mode"] == "amortize"),
                                   "forget": int(d["mode"] == "forget")}  # fmt: skip
        x = ids(4000 + 10 * seed + k, 1)
        cached, _, got = srv.complete(new + x, session)
        assert cached == len(new), (srv.name, k, d, cached, len(new))
        out.append(got)
        seq = new + x
    return out


def _err(a: list[float], b: list[float]) -> float:
    """Largest difference between two sorted top-k lists. The servers key ``top_logprobs``
    by token text, so two tokens that detokenize alike leave one entry: then each served
    value is matched to its nearest counterpart (at most 3 entries may collapse)."""
    if len(a) == len(b):
        return max(abs(x - y) for x, y in zip(a, b, strict=True))
    short, full = (a, b) if len(a) < len(b) else (b, a)
    assert len(short) >= len(full) - 3, (len(a), len(b))
    return max(min(abs(x - y) for y in full) for x in short)


def _between(a: list[float], b: list[float]) -> float:
    """``_err`` between two servers' lists. A collapsed pair of same-text tokens may keep
    a different member on each server: the ``TOP - len`` values left without a counterpart
    are not compared here (each was compared with the oracle by ``_err``)."""
    if len(a) == len(b) == TOP:
        return _err(a, b)
    missing = TOP - min(len(a), len(b))
    assert missing <= 3, (len(a), len(b))
    errs = sorted(min(abs(x - y) for y in b) for x in a)
    return errs[-missing - 1]


@CORE
@pytest.mark.parametrize(("kind", "seed"), CHAIN_CASES)
def test_chains_equal_the_oracle_and_each_other(both, oracle, kind, seed):
    b = both[1].block
    t, steps = _chain(kind, seed, b)
    want = _oracle(oracle, t, steps, seed)
    session = f"chain-{b}-{kind}-{seed}"
    ley, vll = (_run_chain(srv, t, steps, session, seed) for srv in both)
    for k in range(len(steps)):
        assert _err(ley[k], want[k]) <= TOL, ("leyline", k, _err(ley[k], want[k]))
        assert _err(vll[k], want[k]) <= TOL, (both[1].name, b, k, _err(vll[k], want[k]))
        gap = _between(ley[k], vll[k])
        assert gap <= TOL, ("servers differ", b, k, gap)


def test_the_chain_cases_are_the_ones_named():
    """The fixed kinds put their second span where the name says, at both block sizes."""
    for b in (32, 128):
        for seed in CHAIN_SEEDS:
            for kind in ("forget_after_amortize", "second_in_tail"):
                t, (d1, d2) = _chain(kind, seed, b)
                tail = d1["start"] + len(d1["replacement"])
                assert tail < d2["start"] <= tail + 27 and d2["start"] % b, (kind, b, d1, d2)
                assert d2["mode"] == ("forget" if kind.startswith("forget") else "amortize")
            t, (d,) = _chain("first", seed, b)
            assert len(t) % b and d["end"] <= len(t)


@CORE
def test_a_splice_that_ends_on_a_block_boundary_agrees_between_servers(both, oracle):
    """T' a whole number of blocks: both servers keep every spliced row, so the answers must
    agree with each other, and both differ from a re-prefill."""
    b = both[1].block
    t, r, x = ids(71, 5 * b), ids(72, 9), ids(73, 1)
    s, e = 40, 49  # delta = 0: T and T' = 5 whole blocks
    new = t[:s] + r + t[e:]
    assert len(new) % b == 0
    got = []
    for srv in both:
        srv.complete(t, f"edge-{b}")
        resp = srv.directive(
            {"tokens": t, "directives": [{"start": s, "end": e, "replacement": r}]}, f"edge-{b}"
        )
        assert resp.status_code == 200, (srv.name, resp.text)
        cached, _, top = srv.complete(new + x, f"edge-{b}")
        assert cached == len(new), srv.name
        got.append(top)
    want = truth(oracle, RefState.prefill(oracle, t).amortize(s, e, r), len(new), x)
    fresh = truth(oracle, RefState.prefill(oracle, new), len(new), x)
    for top in got:
        assert _err(top, want) <= TOL
    assert _between(got[0], got[1]) <= TOL
    assert _err(want, fresh) > 100 * TOL


# -- bad input ------------------------------------------------------------------------------
T = ids(9, 2 * BLOCK + 5)
D = {"start": 3, "end": 6, "replacement": [7, 8]}
BAD: list[bytes | dict] = [
    b"", b"{", b"nope", b"null", b"[]", b'"x"', b"1", b"true", b"\xff\xfe", b'{"tokens": NaN}',
    b'{"tokens": [1e400], "directives": []}', b'{"tokens": [1, 2], "directives": [] ',
    b"[" * 5000 + b"]" * 5000, b'{"a": ' * 300 + b"1" + b"}" * 300,
    b'{"tokens": [1, 2, 3], "directives": [{"start": 0, "end": 1, "replacement": "a\\ud800"}]}',
    b'{"old_messages": [{"role": "user", "content": "h\\udfffi"}], "new_messages": []}',
    {}, {"tokens": T}, {"directives": [D]}, {"tokens": T, "directives": None},
    {"tokens": T, "directives": "x"}, {"tokens": T, "directives": [1]},
    {"tokens": "abc", "directives": [D]}, {"tokens": [1.5, 2], "directives": [D]},
    {"tokens": ["1", 2], "directives": [D]}, {"tokens": [True, 2], "directives": [D]},
    {"tokens": [-1, 2], "directives": []}, {"tokens": [10**30], "directives": []},
    {"tokens": [7, 10**9], "directives": []}, {"tokens": [[1, 2]], "directives": []},
    {"tokens": T, "directives": [{"start": 9, "end": 3, "replacement": []}]},
    {"tokens": T, "directives": [{"start": -1, "end": 3, "replacement": []}]},
    {"tokens": T, "directives": [{"start": 0, "end": 10**6, "replacement": []}]},
    {"tokens": T, "directives": [{"start": 0, "end": 1}]},
    {"tokens": T, "directives": [{"end": 1, "replacement": []}]},
    {"tokens": T, "directives": [{"start": 0, "replacement": []}]},
    {"tokens": T, "directives": [{"start": "0", "end": 1, "replacement": []}]},
    {"tokens": T, "directives": [{"start": 0.0, "end": 1, "replacement": []}]},
    {"tokens": T, "directives": [{"start": 0, "end": 1, "replacement": None}]},
    {"tokens": T, "directives": [{"start": 0, "end": 1, "replacement": [-3]}]},
    {"tokens": T, "directives": [{"start": 0, "end": 1, "replacement": [1.0]}]},
    {"tokens": T, "directives": [{"start": 0, "end": 1, "replacement": {"a": 1}}]},
    {"tokens": T, "directives": [{**D, "mode": "pin"}]},
    {"tokens": T, "directives": [{**D, "mode": "nope"}]},
    {"tokens": T, "directives": [{**D, "mode": 1}]},
    {"tokens": T, "directives": [{**D, "extra": 1}]},
    {"tokens": T, "directives": [D, D]},
    {"tokens": T, "directives": [D, {"start": 4, "end": 9, "replacement": []}]},
    {"tokens": T, "directives": [D], "extra": 1},
    {"tokens": T, "directives": [D], "mode": "pin"},
    {"tokens": T, "directives": [D], "mode": "sideways"},
    {"tokens": T, "directives": [D], "fallback": "yes"},
    {"tokens": T, "directives": [D], "fallback": 1},
    {"tokens": T, "directives": [D], "request_id": ""},
    {"tokens": T, "directives": [D], "request_id": "x" * 300},
    {"tokens": T, "directives": [D], "request_id": 5},
    {"tokens": T, "directives": [D], "session": ""},
    {"tokens": T, "directives": [D], "session": 5},
    {"tokens": T, "directives": [D], "session": "a\x01b"},
    {"tokens": T, "directives": [D], "model": "other"},
    {"tokens": T, "directives": [D], "model": 5},
    {"tokens": T, "directives": [D], "old_messages": [], "new_messages": []},
    {"old_messages": [{"role": "nobody"}], "new_messages": []},
    {"old_messages": "x", "new_messages": None},
    {"old_messages": [{"role": "user", "content": "hi"}]},
    {"new_messages": [{"role": "user", "content": "hi"}]},
    {"old_messages": [{"role": "user", "content": 5}], "new_messages": []},
    {"old_messages": [{"content": "hi"}], "new_messages": [{"content": "hi"}]},
    {"old_messages": [1], "new_messages": [2]},
    {"old_messages": [], "new_messages": [], "tools": "x"},
    {"old_messages": [], "new_messages": [], "mode": "forgot"},
]  # fmt: skip


def test_the_bad_input_list_is_long_enough():
    assert len(BAD) >= 60


def _send(srv, case: bytes | dict):
    return srv.post("/leyline/v1/directives", raw=case) if isinstance(case, bytes) else (
        srv.directive(case)
    )  # fmt: skip


def _answers(both, case) -> list[tuple[int, dict]]:
    out = []
    for srv in both:
        r = _send(srv, case)
        assert 400 <= r.status_code < 500, (srv.name, r.status_code, r.text)
        err = r.json()["error"]
        assert set(err) >= {"message", "type", "leyline_type", "param", "code", "field"}
        out.append((r.status_code, err))
    return out


@CORE
@pytest.mark.parametrize("i", range(len(BAD)))
def test_bad_input_gets_the_same_4xx_naming_the_same_field(both, i):
    (s1, e1), (s2, e2) = _answers(both, BAD[i])
    assert (s1, e1["type"], e1["field"], e1["param"]) == (s2, e2["type"], e2["field"], e2["param"])


@pytest.mark.parametrize("i", range(len(BAD)))
def test_bad_input_gets_the_same_error_body(both, i):
    answers = _answers(both, BAD[i])
    assert answers[0] == answers[1], json.dumps(answers, indent=1)[:3000]


# -- auth, request_id, limits -----------------------------------------------------------------
@pytest.mark.parametrize("auth", [None, "Bearer wrong-key", "Basic " + KEY, f"Bearer{KEY}"])
def test_every_leyline_route_is_the_same_401_without_the_key(both, auth):
    import httpx

    headers = {"Authorization": auth} if auth else {}
    answers = []
    for srv in both:
        got = []
        for method, path in [("GET", "/leyline/v1/stats"), ("POST", "/leyline/v1/directives"),
                             ("POST", "/leyline/v1/flush")]:  # fmt: skip
            r = httpx.request(method, srv.url + path, json={"tokens": T, "directives": [D]},
                              headers=headers, timeout=60)  # fmt: skip
            assert r.status_code == 401, (srv.name, path, r.text)
            got.append((r.headers.get("www-authenticate"), r.json()))
        answers.append(got)
    assert answers[0] == answers[1]


def test_request_id_reuse_is_the_same_on_both(both):
    t = ids(31, 4 * BLOCK)
    d = {"start": 10, "end": 20, "replacement": [11, 12, 13]}
    seen = []
    for srv in both:
        srv.complete(t, "rid")
        body = {"tokens": t, "directives": [d], "request_id": "rid-1"}
        first = srv.directive(body, "rid")
        again = srv.directive(body, "rid")
        other = srv.directive({**body, "directives": [{**d, "replacement": [14]}]}, "rid")
        elsewhere = srv.directive({**body, "directives": [{**d, "replacement": [14]}]}, "rid-b")
        assert first.status_code == 200 and again.json() == first.json(), srv.name
        assert other.status_code == 400 and other.json()["error"]["field"] == "request_id"
        assert elsewhere.status_code in (200, 409), (srv.name, elsewhere.text)
        err = other.json()["error"]
        seen.append((first.json()["tokens"], err, elsewhere.status_code))
    assert seen[0] == seen[1]


def test_a_40_mb_body_is_the_same_413(both):
    big = b'{"tokens": [' + b"1," * (20 * 1000 * 1000) + b'1], "directives": []}'
    answers = []
    for srv in both:
        r = srv.post("/leyline/v1/directives", raw=big)
        assert r.status_code == 413, (srv.name, r.text[:300])
        answers.append(r.json())
    assert answers[0] == answers[1]


def test_stats_answer_the_same_keys(both):
    keys = [set(srv.stats()) for srv in both]
    assert keys[0] >= keys[1] and {"splices", "rotated_tokens", "prefilled_tokens"} <= keys[1]
    assert TOP == 20


# -- edits in a chat body ----------------------------------------------------------------------
BODY_MSGS = [
    {"role": "system", "content": "You are a careful agent."},
    {"role": "user", "content": "list the files"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
     "function": {"name": "ls", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "a.py b.py c.py d.py " * 40},
    {"role": "user", "content": "and now?"},
]  # fmt: skip


def _body_chat(srv, messages, session, **extra):
    body = {"model": srv.model, "messages": messages, "max_tokens": 1, "temperature": 0,
            "logprobs": True, "top_logprobs": TOP, **extra}  # fmt: skip
    r = srv.post("/v1/chat/completions", body, session=session)
    assert r.status_code == 200, (srv.name, r.text)
    return r.json()


def _chat_truth(
    oracle, held: list[int], span, new_prompt: list[int], reused: int | None = None
) -> tuple[int, list[float]]:
    """(rows of ``T'`` the next prompt reuses, its next-token top log-probs) for AMORTIZE of
    ``span`` over the rows ``held`` (transformers' modules and rotary function); ``reused``:
    at most that many rows of ``T'`` (what a server says it reused)."""
    st = RefState.prefill(oracle, held).amortize(span.start, span.end, span.replacement)
    c = next(c for c in range(len(st.tokens), -1, -1) if st.tokens[:c] == new_prompt[:c])
    c = c if reused is None else min(c, reused)
    head = RefState(oracle, st.tokens[:c], [p[:, :, :c] for p in st.plain],
                    [p[:, :, :c] for p in st.pre])  # fmt: skip
    lp = torch.log_softmax(logits_from_kv(oracle, head.kv(), new_prompt[c:]).double(), -1)
    return c, sorted(lp.tolist(), reverse=True)[:TOP]


def test_edits_riding_in_a_chat_body_are_exact_splices(both, ckpt, oracle):
    """A turn that stubs an earlier tool result with ``leyline.edits``: both servers say the
    edit was spliced, and each turn's next-token log-probs equal AMORTIZE of the edit over
    the rows that server held, computed by transformers (the 4-layer checkpoint: R over a
    wrong context would show). The rows held differ by one: ``leyline serve`` computes the
    KV of the last sampled token of an answer (the reply's), vLLM never does, so on vLLM
    the reply's token is prefilled with the next turn, over the spliced rows."""
    from transformers import AutoTokenizer

    from leyline_agent.directives.compile import message_edits, render

    tok = AutoTokenizer.from_pretrained(ckpt)
    edits = {"client_edits": "amortize", "edits": [{"index": 3, "content": "[elided]"}]}
    for srv in both:
        first = _body_chat(srv, BODY_MSGS, "body-edits")
        reply = first["choices"][0]["message"]["content"] or ""
        turn = [*BODY_MSGS, {"role": "assistant", "content": reply},
                {"role": "user", "content": "go on"}]  # fmt: skip
        j = _body_chat(srv, turn, "body-edits", leyline=edits)
        assert j["leyline"]["edits"] == {"declared": [3], "spliced": [3], "fallback": False}
        top = j["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
        got = sorted((t["logprob"] for t in top), reverse=True)
        cached = j["usage"]["prompt_tokens_details"]["cached_tokens"]

        edited = [dict(m) for m in turn]
        edited[3] = {**edited[3], "content": "[elided]"}
        (span,) = message_edits(tok, turn, edited, None, None).spans
        prompt = render(tok, BODY_MSGS, None, add_generation_prompt=True)
        new_prompt = render(tok, edited, None, add_generation_prompt=True)
        held = prompt + tok.encode(reply, add_special_tokens=False)
        if srv.name == "vllm":
            held = prompt  # no KV for the last sampled token (see the docstring)
        c, want = _chat_truth(oracle, held, span, new_prompt)
        assert cached == c, (srv.name, cached, c)
        assert _err(got, want) <= TOL, (srv.name, _err(got, want))
        # the check can tell: the edited turn prefilled afresh differs
        with torch.inference_mode():
            logits = oracle(input_ids=torch.tensor([new_prompt])).logits[0, -1]
        fresh = sorted(torch.log_softmax(logits.double(), -1).tolist(), reverse=True)[:TOP]
        assert _err(got, fresh) > 100 * TOL, srv.name


def test_a_drifted_head_line_is_an_exact_splice(both, ckpt, oracle):
    """The system prompt's first line changes between two turns of a session (a reasoning
    effort): both servers find the drift in the rendered prompt and splice it, and each
    turn's next-token log-probs equal AMORTIZE of the drift span over the rows that server
    held (transformers), not the fresh prefill."""
    from transformers import AutoTokenizer

    from leyline_agent.directives import Mode
    from leyline_agent.directives.compile import render
    from leyline_agent.directives.drift_plan import plan_drift

    tok = AutoTokenizer.from_pretrained(ckpt)
    rules = " ".join(f"rule {k}: keep the tests green." for k in range(40))
    first = [{"role": "system", "content": f"Reasoning effort: high\n{rules}"},
             {"role": "user", "content": "fix the bug"}]  # fmt: skip
    for srv in both:
        session = f"drift-head-{both[1].block}"  # leyline serve is shared by the vLLM configs
        # four tokens: a reply of one token may be an incomplete character, which vLLM
        # answers as "" (no text for the client to echo, so no proof it holds the reply)
        answer = _body_chat(srv, first, session, max_tokens=4)
        reply = answer["choices"][0]["message"]["content"] or ""
        turn = [{"role": "system", "content": f"Reasoning effort: low\n{rules}"}, first[1],
                {"role": "assistant", "content": reply}, {"role": "user", "content": "go on"}]  # fmt: skip
        j = _body_chat(srv, turn, session)
        assert j["leyline"]["drift"]["spliced"] is True, (srv.name, j["leyline"])
        got = sorted((t["logprob"] for t in j["choices"][0]["logprobs"]["content"][0]["top_logprobs"]),
                     reverse=True)  # fmt: skip
        cached = j["usage"]["prompt_tokens_details"]["cached_tokens"]

        held = render(tok, first, None, add_generation_prompt=True)
        if srv.name == "leyline":  # the reply's rows too (vLLM: see the body-edit test)
            held = held + tok.encode(reply, add_special_tokens=False)
        new_prompt = render(tok, turn, None, add_generation_prompt=True)
        _, req = plan_drift(held, new_prompt, Mode.AMORTIZE)
        (d,) = req.directives
        c, want = _chat_truth(oracle, req.tokens, d, new_prompt, reused=cached)
        assert c == cached >= 0.9 * len(new_prompt), (srv.name, cached, c, len(new_prompt))
        assert _err(got, want) <= TOL, (srv.name, _err(got, want))
        with torch.inference_mode():
            logits = oracle(input_ids=torch.tensor([new_prompt])).logits[0, -1]
        fresh = sorted(torch.log_softmax(logits.double(), -1).tolist(), reverse=True)[:TOP]
        assert _err(got, fresh) > 100 * TOL, srv.name


def test_what_a_chat_body_asks_is_done_on_both(both):
    """Both servers find undeclared client edits and apply ``context_management`` (both list
    ``client_edits``), named session or not: never a 200 that applied nothing."""
    bodies = {
        "context_management": {"edits": [{"type": "clear_tool_uses_20250919",
                                          "trigger": {"type": "input_tokens", "value": 1},
                                          "keep": {"type": "tool_uses", "value": 1}}]},
        "leyline": {"client_edits": "amortize"},
    }  # fmt: skip
    for srv in both:
        assert {"body_edits", "client_edits"} <= set(srv.stats().get("features", [])), srv.name
        for field, value in bodies.items():
            r = srv.post("/v1/chat/completions", {"model": srv.model, "messages": BODY_MSGS,
                                                  "max_tokens": 1, field: value})  # fmt: skip
            assert r.status_code == 200, (srv.name, field, r.text)
            assert r.json()["leyline"]["client_edits"] == "amortize", (srv.name, r.text)
        r = srv.post("/v1/chat/completions", {"model": srv.model, "messages": BODY_MSGS,
                                              "max_tokens": 1, "leyline": {"client_edits": "off"}})
        assert r.status_code == 200 and "leyline" not in r.json(), (srv.name, r.text)


# -- context_management and conversations found by content -------------------------------------
TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "read a file",
          "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}]
CM = {"edits": [{"type": "clear_tool_uses", "trigger": {"type": "input_tokens", "value": 1},
                 "keep": {"type": "tool_uses", "value": 2}}]}  # fmt: skip
CM_STUB = "[stale output of read_file elided]"  # StaleToolTruncation's default placeholder


def _output(k: int, salt: str) -> str:
    return " ".join(f"{salt}line{k}_{j} value={j * k}" for j in range(24))


def _stubbed(history: list[dict], keep: int) -> list[dict]:
    """Tool results older than the newest ``keep`` tool turns replaced by the stub (the
    expected served prompt, built here)."""
    turns = [i for i, m in enumerate(history) if m["role"] == "assistant" and m.get("tool_calls")]
    stale = set(turns[: max(0, len(turns) - keep)])
    return [{**m, "content": CM_STUB} if m["role"] == "tool" and max(
        t for t in turns if t < i) in stale else m for i, m in enumerate(history)]  # fmt: skip


class _Loop:
    """A scripted tool loop of one client (the client echoes the model's text and attaches a
    scripted call, then the tool's output); ``keep``: the client stubs its own stale
    results. ``step()`` sends one turn: (the answer, the messages sent)."""

    def __init__(self, srv, salt: str, session: str | None, keep: int | None = None, **extra):
        self.srv, self.salt, self.session, self.keep, self.extra = srv, salt, session, keep, extra
        self.history = [{"role": "system", "content": f"You are a careful agent {salt}."},
                        {"role": "user", "content": f"Inspect the files {salt} and report."}]  # fmt: skip
        self.k = 0

    def step(self) -> tuple[dict, list[dict]]:
        srv, k = self.srv, self.k
        sent = _stubbed(self.history, self.keep) if self.keep else self.history
        body = {"model": srv.model, "messages": sent, "tools": TOOLS, "tool_choice": "none",
                "max_tokens": 4, "temperature": 0, **self.extra}  # fmt: skip
        r = srv.post("/v1/chat/completions", body, session=self.session)
        assert r.status_code == 200, (srv.name, k, r.text)
        j = r.json()
        call = {"id": f"call_{self.salt}{k}", "type": "function",
                "function": {"name": "read_file", "arguments": f'{{"path": "f{k}.py"}}'}}  # fmt: skip
        text = j["choices"][0]["message"]["content"] or ""
        self.history = [*self.history,
                        {"role": "assistant", "content": text, "tool_calls": [call]},
                        {"role": "tool", "tool_call_id": call["id"],
                         "content": _output(k, self.salt)}]  # fmt: skip
        self.k += 1
        return j, [dict(m) for m in sent]


def _turn_view(j: dict) -> dict:
    """What a turn's answer says the front did (the same on both servers)."""
    lm = j["leyline"]
    return {
        "applied_edits": (j.get("context_management") or {}).get("applied_edits"),
        "edited": lm["edited_messages"],
        "policy_edited": lm["policy_edited_messages"],
        "directives": [(d["kind"], d["outcome"], d.get("splices")) for d in lm["directives"]],
        "prompt_tokens": j["usage"]["prompt_tokens"],
    }


def test_context_management_is_applied_alike(both, ckpt):
    """``context_management`` (clear_tool_uses, keep 2) over a 6-turn tool loop in a named
    session: both servers serve the prompt with the stale results stubbed (its length
    checked against the template's own rendering of the stubbed list), say the same
    ``applied_edits``, splice each newly stale result once (the older stubs stay, with no
    second splice), and reuse the edited previous prompt from the cache."""
    from transformers import AutoTokenizer

    from leyline_agent.directives.compile import render

    tok = AutoTokenizer.from_pretrained(ckpt)
    views = {}
    for srv in both:
        session = f"cm-{both[1].block}"  # leyline serve is shared by the vLLM configs
        loop = _Loop(srv, f"cm{both[1].block}", session, context_management=CM)
        runs = [loop.step() for _ in range(6)]
        views[srv.name] = [_turn_view(j) for j, _ in runs]
        assert len({j["leyline"]["conversation"] for j, _ in runs}) == 1, srv.name
        for t, (j, sent) in enumerate(runs):
            expected = _stubbed(sent, 2)
            assert j["usage"]["prompt_tokens"] == len(render(tok, expected, TOOLS, True)), t
            splices = [d["splices"]["amortize"] for d in j["leyline"]["directives"]]
            assert splices == ([1] if t >= 3 else []), (srv.name, t, j["leyline"])
            if t >= 3:  # the previous prompt, as edited now, came from the cache
                older = len(render(tok, expected[:-2], TOOLS, True))
                cached = j["usage"]["prompt_tokens_details"]["cached_tokens"]
                assert older - 16 <= cached <= older + 4, (srv.name, t, cached, older)
    assert views["leyline"] == views["vllm"]


def test_conversations_are_found_by_content_alike(both):
    """Anonymous clients, interleaved, each stubbing its own stale tool results (client-made
    edits, believed from the reply each one echoes): both servers keep one conversation per
    client, never mixed, and splice each client's newly stubbed result; a named session
    with the same opening as an anonymous client never continues the anonymous one."""
    for srv in both:
        salts = [f"a{both[1].block}", f"b{both[1].block}"]
        loops = {s: _Loop(srv, s, None, keep=2) for s in salts}
        runs: dict[str, list] = {s: [] for s in salts}
        for _ in range(5):  # turn by turn, one client after the other
            for s in salts:
                runs[s].append(loops[s].step())
        convs = []
        for s in salts:
            ids_ = {j["leyline"]["conversation"] for j, _ in runs[s]}
            assert len(ids_) == 1, (srv.name, s, ids_)
            convs.append(ids_.pop())
            edited = [j["leyline"]["edited_messages"] for j, _ in runs[s]]
            assert edited[3:] == [[3], [5]], (srv.name, s, edited)
        assert len(set(convs)) == 2, srv.name
        named = _Loop(srv, salts[0], f"named-{both[1].block}", keep=2)
        for j, _ in (named.step(), named.step()):
            assert j["leyline"]["conversation"] not in convs, srv.name
            assert j["leyline"]["session"] == f"named-{both[1].block}", srv.name


# -- flush ----------------------------------------------------------------------------------
def test_a_flush_forgets_alike(both):
    """``POST /leyline/v1/flush`` on both: the same answer fields, the cached rows freed and
    the chat front's conversations forgotten, so the same prompt is then a full prefill
    (``cached_tokens`` 0) and the next turn of a chat starts a new conversation."""
    t = ids(9100 + both[1].block, 3 * BLOCK + 7)
    answers = []
    for srv in both:
        session = f"flush-{both[1].block}"
        srv.complete(t, session)
        assert srv.complete(t, session)[0] > 0, srv.name
        msgs = [{"role": "system", "content": "You flush."}, *BODY_MSGS[1:]]  # its own text
        first = _body_chat(srv, msgs, session)
        reply = first["choices"][0]["message"]["content"] or ""
        turn = [*msgs, {"role": "assistant", "content": reply},
                {"role": "user", "content": "go on"}]  # fmt: skip
        r = srv.post("/leyline/v1/flush", session=session)
        assert r.status_code == 200, (srv.name, r.text)
        j = r.json()
        assert j["flushed_tokens"] > 0 and j["dropped_conversations"] >= 1, (srv.name, j)
        answers.append(j)
        assert srv.complete(t, session)[0] == 0, srv.name
        after = _body_chat(srv, turn, session)["leyline"]["conversation"]
        assert after != first["leyline"]["conversation"], srv.name  # a continuation, forgotten
    assert set(answers[0]) == set(answers[1])  # tenants: named by leyline serve's key only
