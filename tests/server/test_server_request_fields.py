"""No silent field: every request field is honoured, refused by name, or listed as ignored.

Over HTTP against a real ``leyline serve`` app (tiny llama, its chat template extended here
the way Qwen3's and gpt-oss's templates read ``enable_thinking`` and ``reasoning_effort``).
Expected prompts are rendered here by transformers' own ``apply_chat_template`` from the
messages and tools the request stands for; the server's prompt is read from
``usage.prompt_tokens`` and from the tokens it cached (a follow-up request's
``cached_tokens``).
"""

from __future__ import annotations

import json
import re
import shutil

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from leyline_agent.engine.checkpoints.store import tiny_model_dir
from leyline_agent.engine.checkpoints.templates import TEMPLATES
from leyline_agent.testing.frameworks import scripted_server
from leyline_agent.testing.scripted_engine import tool_call
from leyline_agent.testing.server import serve_in_thread

pytestmark = pytest.mark.slow

GEN = "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
# Qwen3's switch (an empty think block when thinking is off) and a gpt-oss-like effort line
TEMPLATE = (
    "{% if reasoning_effort is defined %}<|im_start|>system\nReasoning: {{ reasoning_effort }}"
    "<|im_end|>\n{% endif %}"
    + TEMPLATES["reasoning"].replace(
        GEN,
        "{% if add_generation_prompt %}<|im_start|>assistant\n"
        "{% if enable_thinking is defined and enable_thinking is false %}"
        "<think>\n\n</think>\n\n{% endif %}{% endif %}",
    )
)
FN = {"type": "object", "properties": {"path": {"type": "string"}}}
NAMESPACE = {
    "type": "namespace",
    "name": "files",
    "description": "file tools",
    "tools": [{"type": "function", "name": "read_file", "description": "read", "parameters": FN}],
}
CODEX_HINTS = {
    "include": ["reasoning.encrypted_content"],
    "reasoning": {"summary": "auto"},
    "client_metadata": {"thread_id": "t"},
    "store": False,
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("qwen3ish") / "model"
    shutil.copytree(tiny_model_dir("llama"), out)
    tok = AutoTokenizer.from_pretrained(out)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def tok(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def server(model_dir):
    from leyline_agent.engine.engine import Engine

    with serve_in_thread(Engine.from_pretrained(model_dir), client_edits="amortize") as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def n_prompt(tok, messages, tools=None, **kw):
    out = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, **kw)
    return len(out if isinstance(out, list) else out["input_ids"])


def post(http, path, body):
    return http.post(path, json=body)


def field_of(r):
    assert r.status_code == 400, r.text
    return r.json()["error"]["param"]


# ---- /v1/responses: Codex's defaults ---------------------------------------------------
def test_responses_codex_hints_are_listed_and_the_prompt_is_the_flattened_tools(http, name, tok):
    body = {
        "model": name, "input": "hi", "max_output_tokens": 2, "temperature": 0,
        "tools": [NAMESPACE, {"type": "web_search"}], **CODEX_HINTS,
    }  # fmt: skip
    r = post(http, "/v1/responses", body)
    assert r.status_code == 200, r.text
    ignored = {n["field"] for n in r.json()["leyline"]["ignored"]}
    assert ignored == {"include[0]", "reasoning.summary", "client_metadata", "tools[1]"}
    flat = [{"type": "function", "function": {"name": "read_file", "description": "read",
                                              "parameters": FN}}]  # fmt: skip
    want = n_prompt(tok, [{"role": "user", "content": "hi"}], flat)
    assert r.json()["usage"]["input_tokens"] == want  # web_search left out, namespace flattened


def test_responses_refuses_what_it_cannot_do_by_name(http, name):
    base = {"model": name, "input": "hi", "max_output_tokens": 2}
    cases = {
        "include[0]": {"include": ["file_search_call.results"]},
        "reasoning.mode": {"reasoning": {"mode": "pro"}},
        "reasoning.effort": {"reasoning": {"effort": "bogus"}},
        "moderation": {"moderation": {"model": "m"}},  # documented by OpenAI, not served
        "frobnicate": {"frobnicate": 1},  # nobody's field
        "tools[0]": {"tools": [{"type": "code_interpreter"}]},
    }
    for want, extra in cases.items():
        assert field_of(post(http, "/v1/responses", {**base, **extra})) == want, want


def test_responses_effort_goes_to_a_template_that_reads_it(http, name, tok):
    base = {"model": name, "input": "hi", "max_output_tokens": 1, "temperature": 0}
    r = post(http, "/v1/responses", {**base, "reasoning": {"effort": "high"}})
    assert r.status_code == 200, r.text
    msgs = [{"role": "user", "content": "hi"}]
    assert r.json()["usage"]["input_tokens"] == n_prompt(tok, msgs, reasoning_effort="high")
    assert "ignored" not in r.json().get("leyline", {})


def test_prompt_cache_key_and_codex_session_id_name_the_session(http, name):
    base = {"model": name, "max_output_tokens": 1, "temperature": 0}
    r = post(http, "/v1/responses", {**base, "input": "one two", "prompt_cache_key": "thread-a"})
    assert r.json()["leyline"]["session"] == "thread-a"
    r = http.post("/v1/responses", json={**base, "input": "three"}, headers={"session-id": "b"})
    assert r.json()["leyline"]["session"] == "b"
    chat = {**base, "messages": [{"role": "user", "content": "four"}], "prompt_cache_key": "c"}
    chat["max_tokens"] = chat.pop("max_output_tokens")
    r = post(http, "/v1/chat/completions", chat)
    assert r.json()["leyline"]["session"] == "c"
    headers = {"X-Leyline-Session": "named"}  # the header wins
    r = http.post("/v1/chat/completions", json={**chat, "prompt_cache_key": "d"}, headers=headers)
    assert r.json()["leyline"]["session"] == "named"
    assert field_of(post(http, "/v1/chat/completions", {**chat, "prompt_cache_key": ""})) == (
        "prompt_cache_key"
    )


def test_a_namespaced_call_names_its_namespace():
    with scripted_server([tool_call("read_file", {"path": "a"})]) as (srv, engine):
        client = openai.OpenAI(base_url=srv.base_url, api_key="none", max_retries=0)
        kw = {"model": engine.model_name, "input": "read a", "tools": [NAMESPACE]}
        done = client.responses.create(**kw)
        with client.responses.stream(**kw) as stream:
            streamed = stream.get_final_response()
    for r in (done, streamed):
        (call,) = [i for i in r.output if i.type == "function_call"]
        assert (call.name, call.namespace) == ("read_file", "files")


def test_ignored_fields_are_counted_per_tenant(http, name):
    before = http.get("/leyline/v1/stats").json()["ignored_fields"].get("reasoning.summary", 0)
    body = {"model": name, "input": "hi", "max_output_tokens": 1, **CODEX_HINTS}
    assert post(http, "/v1/responses", body).status_code == 200
    after = http.get("/leyline/v1/stats").json()["ignored_fields"]["reasoning.summary"]
    assert after == before + 1


# ---- chat: the template's options ------------------------------------------------------
def test_chat_template_kwargs_and_effort_change_the_prompt_as_transformers_renders(
    http, name, tok
):
    msgs = [{"role": "user", "content": "hi"}]
    base = {"model": name, "messages": msgs, "max_tokens": 1, "temperature": 0}
    cases = [
        ({}, {}),
        ({"chat_template_kwargs": {"enable_thinking": False}}, {"enable_thinking": False}),
        ({"reasoning_effort": "low"}, {"reasoning_effort": "low"}),
    ]
    for extra, kw in cases:
        r = post(http, "/v1/chat/completions", {**base, **extra})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == n_prompt(tok, msgs, **kw), extra
    assert n_prompt(tok, msgs, enable_thinking=False) > n_prompt(tok, msgs)  # it can fail


def test_chat_continue_final_message_and_no_generation_prompt(http, name, tok):
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure, the"}]
    body = {"model": name, "messages": msgs, "max_tokens": 1, "temperature": 0}
    r = post(http, "/v1/chat/completions", {**body, "add_generation_prompt": False,
                                             "continue_final_message": True})  # fmt: skip
    want = tok.apply_chat_template(msgs, continue_final_message=True, tokenize=False)
    assert r.json()["usage"]["prompt_tokens"] == len(tok.encode(want, add_special_tokens=False))
    r = post(http, "/v1/chat/completions", {**body, "add_generation_prompt": False})
    want = tok.apply_chat_template(msgs, add_generation_prompt=False, tokenize=False)
    assert r.json()["usage"]["prompt_tokens"] == len(tok.encode(want, add_special_tokens=False))


def test_chat_refuses_and_lists_by_name(http, name):
    base = {"model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    refused = {
        "reasoning_effort": {"reasoning_effort": "bogus"},
        "chat_template_kwargs.nothing_reads_me": {"chat_template_kwargs": {"nothing_reads_me": 1}},
        "continue_final_message": {"continue_final_message": True},
        "web_search_options": {"web_search_options": {}},
        "use_beam_search": {"use_beam_search": True},
        "context_management": {"chat_template_kwargs": {"enable_thinking": False},
                               "context_management": {"edits": []}},
    }  # fmt: skip
    for want, extra in refused.items():
        assert field_of(post(http, "/v1/chat/completions", {**base, **extra})) == want, want
    r = post(http, "/v1/chat/completions", {**base, "user": "u", "service_tier": "auto"})
    assert {n["field"] for n in r.json()["leyline"]["ignored"]} == {"user", "service_tier"}
    r = post(http, "/v1/completions", {"model": name, "prompt": "a", "max_tokens": 1, "user": "u"})
    assert [n["field"] for n in r.json()["leyline"]["ignored"]] == ["user"]
    r = post(http, "/v1/completions", {"model": name, "prompt": "a", "max_tokens": 1, "x": 1})
    assert field_of(r) == "x"


# ---- sampling: vLLM's options against transformers' own logits processors --------------
PROMPT_IDS = [5, 17, 300, 41, 9, 77, 301, 12]


@pytest.fixture(scope="module")
def hf(model_dir):
    from leyline_agent.reference.hf_reference import hf_model

    return hf_model(model_dir)


def hf_text(hf, tok, ids, n, **kw):
    """transformers' generate (its own logits processors) from the token ids ``ids``."""
    import torch

    out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, **kw)
    return tok.decode(out[0, len(ids) :], skip_special_tokens=False)


def complete(http, name, ids, n, **extra):
    body = {"model": name, "prompt": ids, "max_tokens": n, "temperature": 0, **extra}
    r = post(http, "/v1/completions", body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_repetition_penalty_top_k_and_min_p_as_transformers_computes_them(http, name, hf, tok):
    plain = complete(http, name, PROMPT_IDS, 8)["text"]
    penalised = complete(http, name, PROMPT_IDS, 8, repetition_penalty=0.05)["text"]
    assert penalised == hf_text(hf, tok, PROMPT_IDS, 8, repetition_penalty=0.05)
    assert penalised != plain  # the penalty changed the answer: the check can fail
    # top_k 1 and min_p 1 keep only the top token: sampling at temperature 1.5 is greedy
    for extra, kw in (({"top_k": 1}, {"top_k": 1}), ({"min_p": 1.0}, {"min_p": 1.0})):
        texts = {
            complete(http, name, PROMPT_IDS, 8, temperature=1.5, seed=s, **extra)["text"]
            for s in range(3)
        }
        assert texts == {hf_text(hf, tok, PROMPT_IDS, 8, **kw)}, extra
    free = {complete(http, name, PROMPT_IDS, 8, temperature=1.5, seed=s)["text"] for s in range(3)}
    assert len(free) > 1  # without them the seeds give different answers


def test_min_tokens_and_ignore_eos_hold_back_the_stop_token(http, name, hf, tok):
    # a prompt of stop tokens and a penalty below 1 make the stop token the greedy choice
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    ids, boost = [eos] * 4, {"repetition_penalty": 0.01}
    first = complete(http, name, ids, 6, **boost)
    assert (first["text"], first["finish_reason"]) == ("", "stop")
    assert hf_text(hf, tok, ids, 6, **boost) == "<|im_end|>"  # transformers agrees
    held = complete(http, name, ids, 6, min_tokens=3, **boost)
    want = hf_text(hf, tok, ids, 6, min_new_tokens=3, **boost).removesuffix("<|im_end|>")
    assert held["text"] == want and len(tok.encode(want, add_special_tokens=False)) >= 3
    loose = complete(http, name, ids, 6, ignore_eos=True, **boost)
    assert loose["finish_reason"] == "length"


def test_structured_outputs_and_guided_fields_constrain_the_answer(http, name):
    msgs = [{"role": "user", "content": "pick"}]
    base = {"model": name, "messages": msgs, "max_tokens": 24, "temperature": 0}
    cases = [
        ({"structured_outputs": {"choice": ["alpha", "beta"]}}, lambda t: t in ("alpha", "beta")),
        ({"guided_choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
        ({"guided_regex": "[a-c]{5}"}, lambda t: len(t) == 5 and set(t) <= set("abc")),
        ({"structured_outputs": {"grammar": 'root ::= "ok" | "ko"'}}, lambda t: t in ("ok", "ko")),
        ({"guided_json": {"type": "object", "properties": {"n": {"type": "boolean"}},
                          "required": ["n"]}}, lambda t: json.loads(t)["n"] in (True, False)),
    ]  # fmt: skip
    for extra, ok in cases:
        r = post(http, "/v1/chat/completions", {**base, **extra})
        assert r.status_code == 200, r.text
        assert ok(r.json()["choices"][0]["message"]["content"]), extra
    r = post(http, "/v1/completions", {"model": name, "prompt": "x", "max_tokens": 8,
                                       "temperature": 0, "guided_choice": ["one", "two"]})  # fmt: skip
    assert r.json()["choices"][0]["text"] in ("one", "two")
    two = {**base, "guided_regex": "a", "guided_choice": ["a"]}
    assert field_of(post(http, "/v1/chat/completions", two)) == "guided_choice"
    bad = {**base, "structured_outputs": {"whitespace_pattern": " "}}
    assert field_of(post(http, "/v1/chat/completions", bad)) == "structured_outputs.whitespace_pattern"


# ---- every row of docs/server.md's field table, on each route ----------------------------
_NS = {"type": "namespace", "name": "n", "tools": []}
# field -> {route: (value, "ok" | "ignored" | "400")}; "ok": 200 and not listed as ignored
TABLE = {
    "stream": {r: (False, "ok") for r in ("chat", "completions", "responses")},
    "instructions": {"chat": ("x", "400"), "completions": ("x", "400"), "responses": ("x", "ok")},
    "max_tokens": {"chat": (1, "ok"), "completions": (1, "ok"), "responses": (1, "400")},
    "max_completion_tokens": {"chat": (1, "ok"), "completions": (1, "400"), "responses": (1, "400")},
    "max_output_tokens": {"chat": (1, "400"), "completions": (1, "400"), "responses": (1, "ok")},
    "temperature": {r: (0.5, "ok") for r in ("chat", "completions", "responses")},
    "top_p": {r: (0.9, "ok") for r in ("chat", "completions", "responses")},
    "seed": {r: (3, "ok") for r in ("chat", "completions", "responses")},
    "stop": {"chat": (["zz"], "ok"), "completions": (["zz"], "ok"), "responses": (["zz"], "400")},
    "stream_options": {"chat": ({"include_usage": True}, "ok"),
                       "completions": ({"include_usage": True}, "ok"),
                       "responses": ({"include_obfuscation": False}, "ignored")},
    "logprobs": {"chat": (True, "ok"), "completions": (1, "ok"), "responses": (True, "400")},
    "top_logprobs": {"chat": (0, "ok"), "completions": (1, "400"), "responses": (2, "400")},
    "tools": {"chat": ([], "ok"), "completions": ([], "400"), "responses": ([_NS], "ok")},
    "tool_choice": {"chat": ("none", "ok"), "completions": ("none", "400"),
                    "responses": ("none", "ok")},
    "parallel_tool_calls": {"chat": (True, "ok"), "completions": (True, "400"),
                            "responses": (True, "ok")},
    "response_format": {"chat": ({"type": "text"}, "ok"), "completions": ({"type": "text"}, "400"),
                        "responses": ({"type": "text"}, "400")},
    "text": {"chat": ({}, "400"), "completions": ({}, "400"),
             "responses": ({"format": {"type": "text"}}, "ok")},
    **{f: {"chat": (v, "ok"), "completions": (v, "ok"), "responses": (v, "400")}
       for f, v in (("top_k", 5), ("min_p", 0.1), ("repetition_penalty", 1.1), ("min_tokens", 1),
                    ("ignore_eos", False), ("structured_outputs", {"choice": ["a", "b"]}),
                    ("guided_json", {"type": "object"}), ("guided_regex", "[ab]"),
                    ("guided_choice", ["a"]), ("guided_grammar", 'root ::= "a"'))},
    **{f: {"chat": (v, "ok"), "completions": (v, "400"), "responses": (v, "400")}
       for f, v in (("chat_template_kwargs", {"enable_thinking": True}),
                    ("add_generation_prompt", True), ("continue_final_message", False))},
    "reasoning_effort": {"chat": ("low", "ok"), "completions": ("low", "400"),
                         "responses": ("low", "400")},
    "reasoning": {"chat": ({}, "400"), "completions": ({}, "400"),
                  "responses": ({"summary": "auto", "effort": "low"}, "ignored")},
    "include": {"chat": ([], "400"), "completions": ([], "400"),
                "responses": (["reasoning.encrypted_content"], "ignored")},
    "prompt_cache_key": {"chat": ("k", "ok"), "completions": ("k", "400"),
                         "responses": ("k", "ok")},
    "store": {"chat": (True, "ignored"), "completions": (True, "400"), "responses": (False, "ok")},
    "metadata": {"chat": ({"a": "b"}, "ignored"), "completions": ({}, "400"),
                 "responses": ({"a": "b"}, "ok")},
    "previous_response_id": {"chat": ("r", "400"), "completions": ("r", "400")},
    "user": {"chat": ("u", "ignored"), "completions": ("u", "ignored"), "responses": ("u", "ignored")},
    **{f: {"chat": (v, "ignored"), "completions": (v, "400"), "responses": (v, "ignored")}
       for f, v in (("safety_identifier", "s"), ("service_tier", "auto"),
                    ("prompt_cache_retention", "in_memory"), ("prompt_cache_options", {}))},
    **{f: {"chat": (v, "ignored"), "completions": (v, "400"), "responses": (v, "400")}
       for f, v in (("prediction", {"type": "content", "content": "x"}), ("verbosity", "low"))},
    "client_metadata": {"chat": ({}, "400"), "completions": ({}, "400"),
                        "responses": ({"k": "v"}, "ignored")},
    "context_management": {"chat": ({"edits": []}, "ok"), "completions": ({}, "400"),
                           "responses": ({"edits": []}, "ok")},
    "leyline": {"chat": ({"client_edits": "off"}, "ok"), "completions": ({}, "400"),
                "responses": ({"client_edits": "off"}, "ok")},
    "n": {"chat": (2, "400"), "completions": (2, "400"), "responses": (2, "400")},
    **{f: {"chat": (v, "400"), "completions": (v, "400"), "responses": (v, "400")}
       for f, v in (("frequency_penalty", 0.5), ("presence_penalty", 0.5),
                    ("logit_bias", {"1": 1}), ("echo", True), ("best_of", 2), ("suffix", "s"),
                    ("audio", {}), ("modalities", ["text"]), ("functions", []),
                    ("function_call", "none"), ("web_search_options", {}), ("moderation", {}),
                    ("background", True), ("truncation", "auto"), ("max_tool_calls", 1),
                    ("conversation", "c"), ("prompt", {"id": "p"}), ("image", {}),
                    ("background_options", {}), ("access_programs", {}),
                    ("frobnicate", 1))},
}  # fmt: skip
TABLE["prompt"]["completions"] = ("hi", "ok")  # the completions route's prompt is its input


def test_every_field_of_the_table_on_every_route(http, name):
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "server.md").read_text()
    section = doc.split("## Request fields: honoured, refused or ignored", 1)[1].split("\n## ")[0]
    rows = [ln.split("|")[1] for ln in section.splitlines() if ln.startswith("| `")]
    documented = {f for row in rows for f in re.findall(r"`([a-z_]+)", row)}
    routes = {"messages", "input", "model", "frobnicate"}
    assert documented - routes <= set(TABLE), documented - set(TABLE)  # every row is sent
    bases = {
        "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                          "max_tokens": 1}),
        "completions": ("/v1/completions", {"prompt": "hi", "max_tokens": 1}),
        "responses": ("/v1/responses", {"input": "hi", "max_output_tokens": 1}),
    }  # fmt: skip
    for field, per_route in TABLE.items():
        for route, (value, want) in per_route.items():
            path, base = bases[route]
            body = {"model": name, "temperature": 0, **base, field: value}
            r = post(http, path, body)
            where = (field, route)
            if want == "400":
                assert r.status_code == 400, (where, r.text)
                assert r.json()["error"]["param"].split(".")[0].split("[")[0] == field, where
                continue
            assert r.status_code == 200, (where, r.text)
            listed = {n["field"].split(".")[0].split("[")[0]
                      for n in r.json().get("leyline", {}).get("ignored", [])}  # fmt: skip
            assert (field in listed) == (want == "ignored"), (where, listed)
