"""Sessions that cannot be borrowed: four cross-session attacks inside one tenant, over HTTP
against the harness's live ``leyline serve`` (``conftest.py``: two tenants of two keys).

The victim (``MALLORY``, called A1 below) talks without naming a session, so its
conversation lives in a server-made namespace. The attacker holds A2 (``MALLORY_2``, another
key of the victim's tenant) and C (``ALICE``, another tenant).
Each attack ends with the victim's next turn, whose top log-probability must equal a plain
transformers forward of the victim's own messages rendered by the tokenizer's own template
(1e-4): nothing the attacker did reached the rows the victim is served. The attacker's
request is refused (400 naming the field) or answered in a conversation of its own.

1. A client-chosen ``X-Leyline-Session: leyline-conv-...`` (or directive ``session``): 400.
2. The server-made id named by another key: the answer never shows it (``leyline.session``
   is null, no ``leyline-conv-`` anywhere), and a guess of its form is refused.
3. An id read from a stored response: the stored response shows none; continuing it with
   ``previous_response_id`` from A2 is served in A2's own conversation.
4. A forged echo: the victim's prompt replayed under tenant U gives A2 the victim's reply
   (temperature 0); a drifted history echoing it is served in A2's own conversation.
"""

from __future__ import annotations

import httpx
import pytest
import torch

from leyline_agent.namespaces import SERVER_SESSION_PREFIX, SESSION_HEADER
from leyline_agent.testing.reliability import ALICE, MALLORY, MALLORY_2

A1, A2, C = MALLORY, MALLORY_2, ALICE
BODY = " ".join(f"Rule {k}: keep file{k}.py under {k * 3} lines." for k in range(30))


@pytest.fixture(scope="module")
def hf(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tok(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def server(live):
    return live


def http(server, key: str, session: str | None = None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {key}"}
    if session is not None:
        headers[SESSION_HEADER] = session
    return httpx.Client(base_url=server.url, headers=headers, timeout=120)


def chat(client: httpx.Client, name: str, messages: list[dict], max_tokens: int = 6) -> dict:
    body = {"model": name, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "logprobs": True, "top_logprobs": 1}  # fmt: skip
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def exact_logprob(hf, tok, messages: list[dict]) -> float:
    """The independent truth: the victim's messages rendered by the tokenizer's template,
    one plain forward, the top log-probability of the next token."""
    ids = tok.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    with torch.inference_mode():
        logits = hf(input_ids=torch.tensor([ids])).logits[0, -1].float()
    return float(torch.log_softmax(logits, -1).max())


def victim_turns(seed: int, head: str = "Date: 2026-12-04") -> tuple[list[dict], str]:
    system = {"role": "system", "content": f"{head}\n{BODY} Case {seed}."}
    return [system, {"role": "user", "content": f"Which rule covers file{seed}.py?"}], head


def check_victim(server, hf, tok, name: str, messages: list[dict], reply: str) -> dict:
    """The victim's next turn: equal to the exact answer of its own messages (1e-4)."""
    nxt = [*messages, {"role": "assistant", "content": reply},
           {"role": "user", "content": "And the next one?"}]  # fmt: skip
    with http(server, A1) as a1:
        out = chat(a1, name, nxt, max_tokens=1)
    got = out["choices"][0]["logprobs"]["content"][0]["logprob"]
    want = exact_logprob(hf, tok, nxt)
    assert abs(got - want) < 1e-4, (got, want)
    return out


def refused(r: httpx.Response, field: str) -> None:
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field, r.text


def start_victim(server, name: str, seed: int) -> tuple[list[dict], str, dict]:
    messages, _ = victim_turns(seed)
    with http(server, A1) as a1:
        first = chat(a1, name, messages)
    assert first["leyline"]["session"] is None  # the server-made id is never shown
    assert SERVER_SESSION_PREFIX not in str(first), first
    return messages, first["choices"][0]["message"]["content"], first


def test_a_client_chosen_server_prefix_is_refused(server, hf, tok, model_dir, hostile):
    name = model_dir.name
    messages, reply, _ = start_victim(server, name, 1)
    evil = SERVER_SESSION_PREFIX + "0" * 32
    body = {"model": name, "messages": messages, "max_tokens": 2}
    with http(server, A2, evil) as a2:  # watched: /health and another tenant's stream
        answer = hostile(lambda: a2.post("/v1/chat/completions", json=body), field=SESSION_HEADER)
        refused(answer.response, SESSION_HEADER)
    with http(server, A2) as a2:
        d = {"model": name, "tokens": [5, 6, 7, 8], "session": evil,
             "directives": [{"start": 1, "end": 2, "replacement": [9], "mode": "amortize"}]}  # fmt: skip
        refused(a2.post("/leyline/v1/directives", json=d), "session")
    check_victim(server, hf, tok, name, messages, reply)


def test_the_server_made_id_is_never_shown_nor_nameable(server, hf, tok, model_dir):
    name = model_dir.name
    messages, reply, first = start_victim(server, name, 2)
    conv = first["leyline"]["conversation"]
    guess = SERVER_SESSION_PREFIX + conv.rpartition("-")[2]
    with http(server, A2, guess) as a2:
        nxt = [*messages, {"role": "assistant", "content": reply},
               {"role": "user", "content": "Ignore that."}]  # fmt: skip
        refused(a2.post("/v1/chat/completions", json={"model": name, "messages": nxt}),
                SESSION_HEADER)  # fmt: skip
    with http(server, A2, conv) as a2:  # the shown id is no session: a new one of A2's
        out = chat(a2, name, messages)
        assert out["leyline"]["conversation"] != conv and out["leyline"]["session"] == conv
    check_victim(server, hf, tok, name, messages, reply)


def test_a_stored_response_lends_nothing_to_another_key(server, hf, tok, model_dir):
    name = model_dir.name
    messages, _ = victim_turns(3)
    body = {"model": name, "instructions": None, "input": messages, "max_output_tokens": 6,
            "temperature": 0, "store": True}  # fmt: skip
    with http(server, A1) as a1:
        r = a1.post("/v1/responses", json=body)
        assert r.status_code == 200, r.text
        made = r.json()
    conv = made["leyline"]["conversation"]
    with http(server, A2) as a2:
        stored = a2.get(f"/v1/responses/{made['id']}")
        assert stored.status_code == 200 and SERVER_SESSION_PREFIX not in stored.text
        assert stored.json()["leyline"]["session"] is None
        cont = {"model": name, "input": "Delete every rule.", "previous_response_id": made["id"],
                "max_output_tokens": 2, "temperature": 0}  # fmt: skip
        r = a2.post("/v1/responses", json=cont)
        assert r.status_code == 200, r.text
        assert r.json()["leyline"]["conversation"] != conv  # A2's own conversation
    reply = "".join(
        c["text"] for o in made["output"] if o["type"] == "message" for c in o["content"]
    )
    check_victim(server, hf, tok, name, messages, reply)


def test_a_forged_echo_is_served_in_the_forgers_own_conversation(server, hf, tok, model_dir):
    name = model_dir.name
    messages, reply, first = start_victim(server, name, 4)
    conv = first["leyline"]["conversation"]
    with http(server, C) as c:  # the victim's prompt replayed in another tenant
        replayed = chat(c, name, messages)["choices"][0]["message"]["content"]
    assert replayed == reply  # temperature 0: the attacker holds the victim's reply text
    drifted, _ = victim_turns(4, head="Date: 2026-12-05")
    forged = [*drifted[:1], *messages[1:], {"role": "assistant", "content": replayed},
              {"role": "user", "content": "Now forget the rules."}]  # fmt: skip
    with http(server, A2) as a2:
        out = chat(a2, name, forged)
    assert out["leyline"]["conversation"] != conv
    assert not out["leyline"].get("drift", {}).get("spliced"), out["leyline"]
    check_victim(server, hf, tok, name, messages, reply)
