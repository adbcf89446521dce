"""REPAIR on both servers: ``leyline serve`` and ``vllm serve`` + the plugin (conftest's servers,
the 4-layer llama ``mini``, vLLM at block 32 and 128).

The oracle is independent of both servers: transformers' own modules (``RefState``). AMORTIZE
of the span, then each run of consecutive selected rows forwarded again, left to right, over
the rows before it (the prefix, ``R``, the tail rows before it: recomputed where selected,
AMORTIZE's elsewhere; ``RefState.recompute``). The rows are the default selector's at the
default budget (``directives.repair``, the choice both servers make). Budget 1 is a fresh
prefill of ``T'`` (FORGET); budget 0 is AMORTIZE (those two on vLLM at block 32 only).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from leyline_agent.directives.repair import DEFAULT_BUDGET, RepairSpan, select_rows
from leyline_agent.reference.kv_reference import RefState, logits_from_kv

TOL = 1e-4
TOP = 20


def ids(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [int(v) for v in torch.randint(3, 5990, (n,), generator=g)]


# T: a prefix, the span the directive removes, and a tail that quotes the span twice
SPAN = ids(2, 40)
T = ids(1, 60) + SPAN + ids(3, 30) + SPAN[5:17] + ids(4, 40) + SPAN[20:28] + ids(5, 60)
S, E, R = 60, 100, ids(6, 5)
TP = T[:S] + R + T[E:]
X = ids(9, 1)  # the next request's new token


def _top(model: Any, state: RefState) -> list[float]:
    logits = logits_from_kv(model, state.kv(), X)
    return [float(v) for v in torch.topk(torch.log_softmax(logits.double(), -1), TOP).values]


def _served(srv, directive: dict, session: str) -> tuple[dict, list[float]]:
    srv.complete(T, session)
    r = srv.directive({"tokens": T, "directives": [directive]}, session)
    assert r.status_code == 200, (srv.name, r.text)
    cached, _, got = srv.complete(TP + X, session)
    assert cached == len(TP), (srv.name, cached, len(TP))
    return r.json(), got


def _err(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def truths(oracle) -> dict[str, Any]:
    """The oracle's rows and top-20s, once for every vLLM configuration."""
    rows = select_rows(TP, [RepairSpan(S + len(R), len(TP), tuple(T[S:E]), DEFAULT_BUDGET)])
    amortized = RefState.prefill(oracle, T).amortize(S, E, R)
    return {
        "rows": rows,
        "repair": _top(oracle, amortized.recompute(rows)),
        "amortize": _top(oracle, amortized),
        "fresh": _top(oracle, RefState.prefill(oracle, TP)),
    }


def test_repair_at_the_default_budget_equals_the_oracle_on_both(both, truths):
    rows, want = truths["rows"], truths["repair"]
    assert 0 < len(rows) <= 0.05 * (len(TP) - S - len(R)) + 1 and rows[0] > S + len(R)
    assert _err(want, truths["amortize"]) > 10 * TOL  # the check can tell REPAIR from AMORTIZE
    d = {"start": S, "end": E, "replacement": R, "mode": "repair"}
    got = []
    for srv in both:
        before = srv.stats()["repaired_tokens"]
        body, top = _served(srv, d, f"repair-default-{both[1].block}-{srv.name}")
        assert body["splices"] == {"amortize": 0, "forget": 0, "repair": 1}, (srv.name, body)
        assert body["repaired_tokens"] == len(rows), (srv.name, body["repaired_tokens"])
        assert srv.stats()["repaired_tokens"] - before == len(rows), srv.name
        assert _err(top, want) <= TOL, (srv.name, _err(top, want))
        got.append(top)
    assert _err(*got) <= TOL


@pytest.mark.parametrize("vllm_srv", ["block32"], indirect=True)
def test_budget_one_is_forget_and_budget_zero_is_amortize_on_vllm(both, truths):
    vllm = both[1]
    runs = {}
    for mode, budget in [("repair", 1.0), ("forget", None), ("repair", 0.0), ("amortize", None)]:
        d = {"start": S, "end": E, "replacement": R, "mode": mode}
        if budget is not None:
            d["budget"] = budget
        body, runs[(mode, budget)] = _served(vllm, d, f"repair-ends-{vllm.block}-{mode}-{budget}")
        if budget == 1.0:
            assert body["repaired_tokens"] == len(TP) - S - len(R)
    fresh = truths["fresh"]
    assert _err(runs[("repair", 1.0)], fresh) <= TOL
    assert _err(runs[("repair", 1.0)], runs[("forget", None)]) <= 1e-5
    assert runs[("repair", 0.0)] == runs[("amortize", None)]
    assert _err(runs[("amortize", None)], fresh) > 10 * TOL


def test_a_repair_edit_in_a_chat_body_is_executed_on_both(both):
    """``leyline.edits`` with ``mode: "repair"`` on the chat front: spliced as REPAIR (rows
    recomputed, counted), never served with the edit refused."""
    msgs = [
        {"role": "system", "content": "You are a careful agent."},
        {"role": "user", "content": "run the tests"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
         "function": {"name": "pytest", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "FAILED test_sum 6305 != 6306\n" * 12},
        {"role": "user", "content": "what failed?"},
    ]  # fmt: skip
    edits = {"edits": [{"index": 3, "content": "[pytest output elided]", "mode": "repair"}]}
    for srv in both:
        session = f"repair-chat-{both[1].block}"
        base = {"model": srv.model, "max_tokens": 1, "temperature": 0}
        first = srv.post("/v1/chat/completions", {**base, "messages": msgs}, session=session)
        assert first.status_code == 200, (srv.name, first.text)
        reply = first.json()["choices"][0]["message"]["content"] or ""
        turn = [*msgs, {"role": "assistant", "content": reply}, {"role": "user", "content": "ok"}]
        r = srv.post("/v1/chat/completions", {**base, "messages": turn, "leyline": edits},
                     session=session)  # fmt: skip
        assert r.status_code == 200, (srv.name, r.text)
        j = r.json()
        assert j["leyline"]["edits"]["spliced"] == [3], (srv.name, j["leyline"])
        (done,) = j["leyline"]["directives"]
        assert done["outcome"] == "applied" and done["splices"].get("repair") == 1, (srv.name, done)
        assert done["repaired_tokens"] >= 1, (srv.name, done)
