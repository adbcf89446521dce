"""Template drift over HTTP: a real ``leyline serve`` on a three-layer Qwen3 checkpoint made
with ``leyline make-model --template reasoning`` (earlier turns' thinking dropped once a new
user message arrives).

Ground truth never comes from the server: the prompts are rendered here with the
tokenizer's own template, an exact answer is a plain transformers forward of the whole
prompt, and an AMORTIZE answer is ``RefState`` (the model's own modules, keys rotated by the
reference rope) with the think span deleted.

1. A think span stripped by the template is spliced (AMORTIZE) and the next token's
   log-probability equals the AMORTIZE truth (1e-4), and differs from a fresh prefill's.
2. Another session, or an anonymous repeat, sending the same drifted prompt gets a fresh
   prefill's answer (never the spliced rows).
3. A request that does not echo the reply gets an exact prefill (nothing is spliced).
4. A changed head line ("Reasoning effort: high" -> "low", token < 16) before a long system
   prompt costs one splice: the next request's cached tokens are >= 95 % of its prompt.
"""

from __future__ import annotations

import httpx
import pytest
import torch

from leyline_agent.namespaces import SESSION_HEADER
from leyline_agent.reference.kv_reference import RefState, logits_from_kv
from leyline_agent.testing.server import serve_in_thread

pytestmark = pytest.mark.slow

THINK = " ".join(f"step {k}: check the value of x{k} against the spec." for k in range(25))
CALL = {"id": "call_drift0", "type": "function",
        "function": {"name": "read_file", "arguments": '{"path": "a.py"}'}}  # fmt: skip
TOOL_OUT = " ".join(f"line{j} = {j * 7}" for j in range(60))
HEAD_SENTENCES = 1000  # about 8k tokens of system prompt after the head line


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import AutoTokenizer

    from leyline_agent.engine.checkpoints.modelgen import make_model
    from leyline_agent.engine.checkpoints.store import tiny_model_dir

    tok = AutoTokenizer.from_pretrained(tiny_model_dir("qwen3"))
    out = tmp_path_factory.mktemp("drift") / "qwen3-reasoning-3l"
    return make_model("qwen3", "tiny", out, seed=5, tokenizer=tok, template="reasoning", layers=3)


@pytest.fixture(scope="module")
def tok(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def hf(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def srv(model_dir):
    from leyline_agent.engine.engine import Engine
    from leyline_agent.server.app import create_app

    with serve_in_thread(
        create_app(Engine.from_pretrained(model_dir), client_edits="amortize")
    ) as s:
        yield s


def render(tok, messages) -> list[int]:
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tok.encode(text, add_special_tokens=False))


def chat(srv, name, messages, *, n=4, session=None, leyline=None):
    body = {"model": name, "messages": messages, "max_tokens": n, "temperature": 0,
            "logprobs": True, "top_logprobs": 1}  # fmt: skip
    if leyline is not None:
        body["leyline"] = leyline
    headers = {SESSION_HEADER: session} if session else {}
    r = httpx.post(f"{srv.url}/v1/chat/completions", json=body, headers=headers, timeout=600)
    assert r.status_code == 200, r.text
    return r.json()


def first_logprob(body) -> float:
    return body["choices"][0]["logprobs"]["content"][0]["logprob"]


def stats(srv):
    return httpx.get(f"{srv.url}/leyline/v1/stats", timeout=60).json()


def greedy(hf, ids: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)
    return out[0, len(ids) :].tolist()


def fresh_logprob(hf, ids: list[int]) -> float:
    with torch.inference_mode():
        logits = hf(input_ids=torch.tensor([ids])).logits[0, -1].float()
    return float(torch.log_softmax(logits, -1).max())


def echo(body) -> dict:
    """The client's copy of the reply: its text (the reasoning sent back separately)."""
    text = body["choices"][0]["message"]["content"]
    assert text, "the reply must have text for the echo proof"
    return {"role": "assistant", "content": text}


@pytest.fixture(scope="module")
def conversation(srv, tok, hf, model_dir):
    """Three turns of one anonymous client. Turn 2 sends turn 1's reply back with its thinking
    and a tool call (the template renders the think block before the reply: an insertion that
    would keep only the reply's few tokens, so it is prefilled: turn 2 is exact and its greedy
    output is known); turn 3 adds a user
    message, so the template drops that think block: a deletion, AMORTIZE by default."""
    name = model_dir.name
    m1 = [{"role": "system", "content": "You are a careful agent."},
          {"role": "user", "content": "Inspect a.py and report."}]  # fmt: skip
    b1 = chat(srv, name, m1)
    asst1 = {**echo(b1), "reasoning_content": THINK, "tool_calls": [CALL]}
    m2 = [*m1, asst1, {"role": "tool", "tool_call_id": CALL["id"], "content": TOOL_OUT}]
    b2 = chat(srv, name, m2, n=6)
    assert "drift" not in b2["leyline"], b2["leyline"]  # a 4-token tail: prefilled, exact
    p2 = render(tok, m2)
    out2 = greedy(hf, p2, 6)  # turn 2 was exact: its answer is the plain model's greedy one
    assert tok.decode(out2, skip_special_tokens=True) == b2["choices"][0]["message"]["content"]
    m3 = [*m2, echo(b2), {"role": "user", "content": "Now summarise."}]
    before = stats(srv)
    b3 = chat(srv, name, m3)
    return {"m3": m3, "b3": b3, "T2": p2 + out2, "N3": render(tok, m3), "before": before}


def test_think_deletion_equals_the_amortize_truth(conversation, hf, srv):
    T2, N3, b3 = conversation["T2"], conversation["N3"], conversation["b3"]
    drift = b3["leyline"]["drift"]
    assert drift["spliced"] and b3["usage"]["leyline"]["splices"]["amortize"] == 1, drift
    # the truth, found here: the think block is where T2 and N3 part, and T2 resumes in N3
    p = next(i for i, (a, b) in enumerate(zip(T2, N3, strict=False)) if a != b)
    d = next(k for k in range(1, len(T2) - p) if T2[p + k :] == N3[p : len(T2) - k])
    assert d > 100  # the whole think block (a few hundred tokens) is deleted
    truth = RefState.prefill(hf, T2).amortize(p, p + d, [])
    rest = N3[len(T2) - d :]
    with torch.inference_mode():
        want = float(torch.log_softmax(logits_from_kv(hf, truth.kv(), rest), -1).max())
    got = first_logprob(b3)
    assert got == pytest.approx(want, abs=1e-4)
    assert abs(got - fresh_logprob(hf, N3)) > 1e-3  # the two truths differ: the test can tell
    assert b3["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(T2) - d
    after = stats(srv)
    assert after["drift_splices"] == conversation["before"]["drift_splices"] + 1


@pytest.mark.parametrize("session", ["other-session", None])
def test_another_session_gets_a_fresh_prefill(conversation, hf, srv, model_dir, session):
    body = chat(srv, model_dir.name, conversation["m3"], session=session)
    assert "drift" not in body.get("leyline", {}) or not body["leyline"]["drift"]["spliced"]
    assert first_logprob(body) == pytest.approx(fresh_logprob(hf, conversation["N3"]), abs=1e-4)


def test_a_request_without_the_echo_is_exact(hf, srv, tok, model_dir):
    """It continues a conversation message for message, but its assistant message is not
    the reply the server gave: the drift the template makes is found and not believed."""
    prior = {"role": "assistant", "content": "prior answer", "reasoning_content": THINK,
             "tool_calls": [CALL]}  # fmt: skip
    m1 = [{"role": "system", "content": "You are an agent without proof."},
          {"role": "user", "content": "Inspect b.py."}, prior,
          {"role": "tool", "tool_call_id": CALL["id"], "content": TOOL_OUT}]  # fmt: skip
    chat(srv, model_dir.name, m1)  # its think block is rendered (after the last user message)
    fake = {"role": "assistant", "content": "an answer this server never gave"}
    m2 = [*m1, fake, {"role": "user", "content": "Go on."}]  # the think block is dropped
    before = stats(srv)
    body = chat(srv, model_dir.name, m2)
    assert body["leyline"]["drift"]["unspliced"] == "unproven", body["leyline"]
    assert first_logprob(body) == pytest.approx(fresh_logprob(hf, render(tok, m2)), abs=1e-4)
    after = stats(srv)
    assert after["splices"] == before["splices"]  # nothing spliced
    unproven = before["drift_unspliced"].get("unproven", 0)
    assert after["drift_unspliced"]["unproven"] == unproven + 1


def test_head_line_drift_costs_one_splice(srv, model_dir, tok):
    name = model_dir.name
    filler = " ".join(f"rule{k % 97} applies to case {k}." for k in range(HEAD_SENTENCES))
    sys_high = {"role": "system", "content": f"Reasoning effort: high\n{filler}"}
    m1 = [sys_high, {"role": "user", "content": "Go."}]
    high, low = (
        render(tok, m1),
        render(
            tok, [{**sys_high, "content": sys_high["content"].replace("high", "low", 1)}, m1[1]]
        ),
    )
    assert next(i for i, (a, b) in enumerate(zip(high, low, strict=False)) if a != b) < 16
    b1 = chat(srv, name, m1, session="head")
    sys_low = {"role": "system", "content": f"Reasoning effort: low\n{filler}"}
    m2 = [sys_low, m1[1], echo(b1), {"role": "user", "content": "Again."}]
    before = stats(srv)
    b2 = chat(srv, name, m2, session="head")
    prompt, cached = (
        b2["usage"]["prompt_tokens"],
        b2["usage"]["prompt_tokens_details"]["cached_tokens"],
    )
    print(f"head-line drift: prompt {prompt} tokens, cached {cached} ({cached / prompt:.3f})")
    assert prompt > 7000
    assert cached >= 0.95 * prompt, b2["leyline"]
    after = stats(srv)
    assert after["splices"]["amortize"] == before["splices"]["amortize"] + 1
    assert after["drift_splices"] == before["drift_splices"] + 1
