"""REPAIR over HTTP on a real ``leyline serve`` (tiny llama): every way a directive arrives.

Ground truth for budget 1: transformers' own forward of ``T'`` (a REPAIR that recomputes the
whole tail is a fresh prefill). The other paths check what the answer and the stats count
(the rows' values are the engine tests' job: ``test_engine_repair``).
"""

from __future__ import annotations

import pytest
import torch

from leyline_agent.testing.token_ids import random_ids

pytestmark = pytest.mark.slow

ARCH = "llama"
K = 2

SERVER_KWARGS = {"client_edits": "repair"}


@pytest.fixture(scope="module")
def arch():
    return ARCH


def _conversation(result: str) -> list[dict]:
    return [
        {"role": "system", "content": "You are a careful coding agent."},
        {"role": "user", "content": "Run the tests."},
        {"role": "assistant", "content": "I'll run pytest."},
        {"role": "tool", "content": result},
        {"role": "user", "content": "What failed?"},
    ]


def test_token_form_budget_one_is_transformers_prefill(client, http, name, ref_model):
    T, R, X = random_ids(31, 60), random_ids(32, 4), random_ids(33, 3)
    client.completions.create(model=name, prompt=T, max_tokens=1, temperature=0)
    before = http.get("/leyline/v1/stats").json()
    d = {"start": 10, "end": 25, "replacement": R, "mode": "repair", "budget": 1.0}
    resp = http.post("/leyline/v1/directives", json={"tokens": T, "directives": [d]})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    Tp = T[:10] + R + T[25:]
    assert body["tokens"] == Tp and body["splices"]["repair"] == 1
    assert body["repaired_tokens"] == len(Tp) - 10 - len(R)
    after = http.get("/leyline/v1/stats").json()
    assert after["repaired_tokens"] - before["repaired_tokens"] == body["repaired_tokens"]
    r = client.completions.create(model=name, prompt=Tp + X, max_tokens=1, temperature=0,
                                  logprobs=K)  # fmt: skip
    assert r.usage.prompt_tokens_details.cached_tokens >= len(Tp)
    with torch.no_grad():
        logits = ref_model(input_ids=torch.tensor([Tp + X])).logits[0, -1].float()
    want = torch.log_softmax(logits, -1).max().item()
    assert abs(r.choices[0].logprobs.token_logprobs[0] - want) <= 1e-4


def test_message_form_repair_with_a_budget(client, http, name):
    old = _conversation("FAILED test_sum - assert 6305 == 6306\n" * 8)
    new = _conversation("[output of pytest removed]")
    client.chat.completions.create(model=name, messages=old, max_tokens=1, temperature=0)
    body = {"old_messages": old, "new_messages": new, "mode": "repair", "budget": 0.25}
    resp = http.post("/leyline/v1/directives", json=body)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    assert out["splices"]["repair"] == 1 and out["repaired_tokens"] >= 1
    bad = http.post("/leyline/v1/directives", json={**body, "mode": "amortize"})
    assert bad.status_code == 400 and "budget" in bad.text


TOOLS = [{"type": "function", "function": {"name": "read_file", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]
CM = {"edits": [{"type": "clear_tool_uses", "trigger": {"type": "input_tokens", "value": 1},
                 "keep": {"type": "tool_uses", "value": 1}}]}  # fmt: skip


def test_context_management_splices_in_repair(client, name):
    """A tool loop whose older results ``context_management`` clears: on a server whose
    client edits default to repair, each newly cleared result is a REPAIR splice."""
    history = [
        {"role": "system", "content": "You are a careful agent."},
        {"role": "user", "content": "Inspect the files and report."},
    ]
    usages = []
    for k in range(4):
        r = client.chat.completions.create(
            model=name, messages=history, tools=TOOLS, max_tokens=6, temperature=0,
            extra_body={"context_management": CM},
        )  # fmt: skip
        usages.append(r.usage.model_extra.get("leyline") or {})
        call = {"id": f"call_{k}", "type": "function",
                "function": {"name": "read_file", "arguments": f'{{"path": "f{k}.py"}}'}}
        history = [
            *history,
            {"role": "assistant", "content": r.choices[0].message.content or "",
             "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"],
             "content": f"def f{k}():\n    return {7000 + k}\n" * 6},
        ]  # fmt: skip
    repaired = [u.get("splices", {}).get("repair", 0) for u in usages]
    assert repaired[2:] == [1, 1], usages
    assert all(u["repaired_tokens"] >= 1 for u in usages[2:])


@pytest.mark.parametrize(
    ("directive", "param"),
    [
        ({"mode": "amortize", "budget": 0.5}, "directives[0]"),
        ({"mode": "repair", "budget": 2}, "directives[0].budget"),
        ({"mode": "repair", "budget": "0.1"}, "directives[0].budget"),
    ],
)
def test_bad_budgets_are_400_naming_the_field(http, directive, param):
    T = random_ids(41, 20)
    d = {"start": 2, "end": 5, "replacement": [7], **directive}
    resp = http.post("/leyline/v1/directives", json={"tokens": T, "directives": [d]})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"].startswith(param)
