"""Real trained weights on both servers: SmolLM2-135M-Instruct (``leyline fetch-model``).

The rest of this folder runs on random-weight checkpoints; here the same contract is checked
on a real model (30 layers, GQA 9/3, real attention patterns) and real text: an agent
conversation from ``quality_data`` (real command output, ChatML), its stale tool output
stubbed by a directive. One ``leyline serve`` and one ``vllm serve`` + plugin (block 32),
behind conftest's key, one model load each for the module:

- a single AMORTIZE and a chain of 3 directives (AMORTIZE, AMORTIZE inside the first
  splice's tail, FORGET): after each, both servers keep every row of ``T'``
  (``cached_tokens == len(T')``) and their next-token top-20 log-probs equal the
  independent oracle (``RefState``: transformers' own modules and rotary function, fp64
  log-softmax) within 1e-4;
- the stub as a REPAIR at the default budget: both servers equal the oracle (AMORTIZE, then
  the rows ``directives.repair`` selects recomputed, ``RefState.recompute``) within 1e-4;
- greedy answers (16 tokens) of both servers equal transformers' own greedy decoding
  (``hf_greedy``: the whole sequence recomputed at every step) on a chat prompt and on the
  conversation.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch

from leyline_agent.directives.repair import DEFAULT_BUDGET, RepairSpan, select_rows
from leyline_agent.experiments.check.quality_data import load_conversations
from leyline_agent.reference.hf_reference import hf_greedy
from leyline_agent.reference.kv_reference import RefState, logits_from_kv
from leyline_agent.testing.server import serve_vllm

KEY = "sk-conformance"  # conftest's
TOL = 1e-4
TOP = 20
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def smollm2() -> Path:
    """The folder ``leyline fetch-model smollm2`` makes (run with ``.venv``, which has gguf)."""
    py = os.environ.get("LEYLINE_MAIN_PYTHON", str(ROOT / ".venv" / "bin" / "python"))
    out = subprocess.run([py, "-m", "leyline_agent.cli", "fetch-model", "smollm2"],
                         capture_output=True, text=True, timeout=900)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    return Path(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def tok(smollm2):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2)


@pytest.fixture(scope="module")
def oracle(smollm2):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def servers(smollm2, start_leyline):
    leyline_process, client = start_leyline
    with leyline_process(smollm2) as ley, client() as c:
        with serve_vllm(smollm2, block_size=32, extra_args=["--api-key", KEY]) as vll:
            yield [("leyline", ley.url, smollm2.name, c), ("vllm", vll.url, vll.model, c)]


def _ids(tok, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"])


@pytest.fixture(scope="module")
def conversation(tok):
    """``T`` (a real agent conversation, 7 messages), the stub's edit and the question."""
    conv = next(c for c in load_conversations() if c["id"] == "general-02")
    msgs, k = conv["messages"][:7], conv["stale"]
    render = lambda m: tok.apply_chat_template(m, tokenize=False)  # noqa: E731
    t, stubbed = _ids(tok, render(msgs)), _ids(tok, render([*msgs[:k], {**msgs[k], "content": conv["stub"]}, *msgs[k + 1 :]]))
    s = next(i for i, (a, b) in enumerate(zip(t, stubbed, strict=False)) if a != b)
    tail = next(j for j in range(1, len(t)) if t[-j] != stubbed[-j]) - 1
    q = tok.apply_chat_template([{"role": "user", "content": conv["question"]}], tokenize=False,
                                add_generation_prompt=True).split("<|im_end|>\n", 1)[1]  # fmt: skip
    return t, {"start": s, "end": len(t) - tail, "replacement": stubbed[s : len(stubbed) - tail]}, _ids(tok, q)


def _complete(srv, prompt: list[int], max_tokens: int = 1, session: str | None = None) -> dict:
    name, url, model, c = srv
    h = {"X-Leyline-Session": session} if session else {}
    r = c.post(url + "/v1/completions", headers=h, json={
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": TOP,
    })  # fmt: skip
    assert r.status_code == 200, (name, r.text)
    return r.json()


def _top(j: dict) -> list[float]:
    return sorted(j["choices"][0]["logprobs"]["top_logprobs"][0].values(), reverse=True)


def _truth(model, state: RefState, x: list[int]) -> list[float]:
    lp = torch.log_softmax(logits_from_kv(model, state.kv(), x).double(), -1)
    return [float(v) for v in torch.topk(lp, TOP).values]


def _err(served: list[float], want: list[float]) -> float:
    """Largest gap; tokens that detokenize alike share one text key in the server's answer,
    so a shorter list (at most 3 collapsed) is matched value by nearest value."""
    assert len(served) >= TOP - 3, len(served)
    return max(min(abs(x - y) for y in want) for x in served)


def _chain(srv, oracle, t, steps, x, session) -> list[float]:
    """Run ``steps`` (directives on the current sequence) after caching ``t``; per step the
    error of the served top-20 after ``T' + x`` against the oracle's."""
    name, url, _, c = srv
    _complete(srv, t, session=session)
    state, seq, errs = RefState.prefill(oracle, t), list(t), []
    for d in steps:
        r = c.post(url + "/leyline/v1/directives", headers={"X-Leyline-Session": session},
                   json={"tokens": seq, "directives": [d]})  # fmt: skip
        assert r.status_code == 200, (name, r.text)
        new = seq[: d["start"]] + d["replacement"] + seq[d["end"] :]
        assert r.json()["tokens"] == new and r.json()["outcome"] == "applied", name
        s, e, rep = d["start"], d["end"], d["replacement"]
        state = state.amortize(s, e, rep) if d["mode"] == "amortize" else state.forget(s, e, rep)
        j = _complete(srv, new + x, session=session)
        assert j["usage"]["prompt_tokens_details"]["cached_tokens"] == len(new), (name, d)
        errs.append(_err(_top(j), _truth(oracle, state, x)))
        state, seq = state.extend(x), new + x
    return errs


def test_a_single_stub_is_exact_on_both(servers, oracle, conversation):
    t, stub, x = conversation
    for srv in servers:
        errs = _chain(srv, oracle, t, [{**stub, "mode": "amortize"}], x, f"one-{srv[0]}")
        assert max(errs) <= TOL, (srv[0], errs)


def test_a_chain_of_three_is_exact_on_both(servers, oracle, conversation, tok):
    t, stub, x = conversation
    tail = stub["start"] + len(stub["replacement"])  # first row of the stub's tail in T'
    steps = [
        {**stub, "mode": "amortize"},
        {"start": tail + 9, "end": tail + 15, "replacement": _ids(tok, " the ledger files"), "mode": "amortize"},
        {"start": tail + 3, "end": tail + 5, "replacement": _ids(tok, " checked"), "mode": "forget"},
    ]  # fmt: skip
    for srv in servers:
        errs = _chain(srv, oracle, t, steps, x[:1], f"three-{srv[0]}")
        assert max(errs) <= TOL, (srv[0], errs)


@pytest.mark.parametrize("which", ["chat", "conversation"])
def test_greedy_answers_equal_transformers(servers, smollm2, tok, conversation, which):
    t, _, x = conversation
    if which == "chat":
        text = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                       tokenize=False, add_generation_prompt=True)  # fmt: skip
        prompt = _ids(tok, text)
    else:
        prompt = t + x
    want = hf_greedy(smollm2, prompt, 16, stop_ids=[tok.eos_token_id])
    text = tok.decode([i for i in want.token_ids if i != tok.eos_token_id])
    for srv in servers:
        got = _complete(srv, prompt, 16)["choices"][0]["text"]
        assert got == text, (srv[0], got, text)


def test_a_repair_stub_equals_the_oracle_on_both(servers, oracle, conversation):
    t, stub, x = conversation
    s, e, r = stub["start"], stub["end"], stub["replacement"]
    new = t[:s] + r + t[e:]
    rows = select_rows(new, [RepairSpan(s + len(r), len(new), tuple(t[s:e]), DEFAULT_BUDGET)])
    amortized = RefState.prefill(oracle, t).amortize(s, e, r)
    want = _truth(oracle, amortized.recompute(rows), x)
    for srv in servers:
        name, url, _, c = srv
        session = f"repair-{name}"
        _complete(srv, t, session=session)
        d = {**stub, "mode": "repair"}
        resp = c.post(url + "/leyline/v1/directives", headers={"X-Leyline-Session": session},
                      json={"tokens": t, "directives": [d]})  # fmt: skip
        assert resp.status_code == 200, (name, resp.text)
        assert resp.json()["repaired_tokens"] == len(rows) > 0, (name, resp.json())
        j = _complete(srv, new + x, session=session)
        assert j["usage"]["prompt_tokens_details"]["cached_tokens"] == len(new), name
        assert _err(_top(j), want) <= TOL, (name, _err(_top(j), want))
