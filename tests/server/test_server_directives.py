"""Directives over HTTP: the engine's splice checks through the server, bad inputs, binding.

Ground truths: FORGET and plain requests against plain Hugging Face forwards; AMORTIZE
(which by design is not a fresh prefill) against a separate in-process ``Engine``
instance loaded from the same weights and given the same calls; message-form tokens
against the tokenizer's own chat template.
"""

from __future__ import annotations

import threading

import httpx
import numpy as np
import pytest

from leyline_agent.reference.hf_reference import hf_greedy
from leyline_agent.testing.server import wait_ready
from leyline_agent.testing.token_ids import random_ids
from leyline_agent.wire import DirectivesRequest

ARCH = "deepseek_v2"
K = 2




@pytest.fixture(scope="module")
def ref(model_dir):
    """An independent engine instance (same weights) fed the same calls in-process."""
    from leyline_agent.engine.engine import Engine

    return Engine.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def _params(max_tokens: int, logprobs: bool = False):
    from leyline_agent.engine.params import SamplingParams

    return SamplingParams(
        max_tokens=max_tokens, logprobs=logprobs, top_logprobs=K if logprobs else 0
    )


def _complete(client, name, ids, max_tokens):
    r = client.completions.create(
        model=name, prompt=ids, max_tokens=max_tokens, temperature=0, logprobs=K
    )
    return r, r.choices[0]


def test_amortize_over_http_equals_an_independent_engine(client, http, name, ref):
    T, R, X = random_ids(11, 48), random_ids(12, 5), random_ids(13, 4)
    d = {"start": 12, "end": 22, "replacement": R, "mode": "amortize"}
    T2 = T[:12] + R + T[22:]
    _complete(client, name, T, 1)
    resp = http.post("/leyline/v1/directives", json={"tokens": T, "directives": [d]})
    assert resp.status_code == 200, resp.text
    assert resp.json()["tokens"] == T2 and resp.json()["splices"]["amortize"] == 1
    r, c = _complete(client, name, T2 + X, 6)
    assert r.usage.prompt_tokens_details.cached_tokens >= len(T2)

    ref.generate(T, _params(1))
    ref.apply_directives(DirectivesRequest(tokens=T, directives=[d]))
    want = ref.generate(T2 + X, _params(6, logprobs=True))
    assert c.text == want.text and r.usage.completion_tokens == len(want.output_ids)
    np.testing.assert_allclose(
        c.logprobs.token_logprobs, [e.logprob for e in want.logprobs], atol=1e-5
    )


def test_plain_prefix_cache_without_a_directive_reuses_only_the_prefix(client, name):
    T, R, X = random_ids(14, 40), random_ids(15, 5), random_ids(16, 3)
    _complete(client, name, T, 1)
    r, _ = _complete(client, name, T[:12] + R + T[22:] + X, 1)
    assert r.usage.prompt_tokens_details.cached_tokens == 12


def test_forget_over_http_equals_a_fresh_prefill(client, http, name, tok, model_dir, stop_ids):
    T, R, X = random_ids(17, 44), random_ids(18, 3), random_ids(19, 4)
    d = {"start": 20, "end": 30, "replacement": R, "mode": "forget"}
    T2 = T[:20] + R + T[30:]
    _complete(client, name, T, 1)
    resp = http.post("/leyline/v1/directives", json={"tokens": T, "directives": [d]}).json()
    assert resp["tokens"] == T2 and resp["splices"]["forget"] == 1
    r, c = _complete(client, name, T2 + X, 6)
    assert r.usage.prompt_tokens_details.cached_tokens >= len(T2)
    g = hf_greedy(model_dir, T2 + X, 6, stop_ids)
    assert c.text == tok.decode(g.token_ids, skip_special_tokens=True)
    np.testing.assert_allclose(c.logprobs.token_logprobs, g.logprobs, atol=1e-4)


def _conversation(result: str) -> list[dict]:
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "read_file", "arguments": '{"path": "a.py"}'},
    }
    return [
        {"role": "system", "content": "You are a careful coding agent."},
        {"role": "user", "content": "Fix the failing test in a.py."},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": result},
        {"role": "user", "content": "Now run the tests."},
    ]


def test_message_form_amortize_over_http(client, http, name, tok, ref):
    old = _conversation("def add(a, b):\n    return a - b\n" * 6)
    new = _conversation("[output of read_file removed]")
    kw = dict(model=name, max_tokens=1, temperature=0)
    client.chat.completions.create(messages=old, **kw)
    resp = http.post("/leyline/v1/directives", json={"old_messages": old, "new_messages": new})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    want_tokens = tok.apply_chat_template(new, tokenize=False, add_generation_prompt=False)
    assert body["tokens"] == tok.encode(want_tokens, add_special_tokens=False)
    assert body["splices"]["amortize"] >= 1
    r = client.chat.completions.create(messages=new, logprobs=True, **{**kw, "max_tokens": 5})
    assert r.usage.prompt_tokens_details.cached_tokens >= len(body["tokens"])

    ref.generate(ref.render(old), _params(1))
    ref.apply_directives(DirectivesRequest(old_messages=old, new_messages=new))
    want = ref.generate(ref.render(new), _params(5, logprobs=True))
    assert r.choices[0].message.content == want.text
    np.testing.assert_allclose(
        [x.logprob for x in r.choices[0].logprobs.content],
        [e.logprob for e in want.logprobs],
        atol=1e-5,
    )


def _bad_requests(name: str, T: list[int]) -> list[tuple[str, dict | bytes, int, str | None]]:
    ok_chat = {"model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    ok_cmpl = {"model": name, "prompt": T[:5], "max_tokens": 1}
    d = {"start": 5, "end": 8, "replacement": [7]}
    dirs = "/leyline/v1/directives"
    return [
        (dirs, {"tokens": T, "directives": [{**d, "end": 99}]}, 400, "directives[0].end"),
        (dirs, {"tokens": T, "directives": [d, {**d, "start": 6, "end": 9}]}, 400, "directives[1]"),
        (dirs, {"tokens": T, "directives": [{**d, "mode": "pin"}]}, 400, "directives[0].mode"),
        (dirs, {"tokens": T, "directives": [{**d, "start": 9}]}, 400, "directives[0]"),
        (dirs, {"tokens": T, "directives": [{**d, "replacement": [7, 10**6]}]}, 400, "directives[0].replacement[1]"),
        (dirs, {"tokens": T, "directives": [{**d, "replacement": [-3]}]}, 400, "directives[0].replacement"),
        (dirs, {"tokens": [*T[:3], 10**7], "directives": [d]}, 400, "tokens[3]"),
        (dirs, {"tokens": T, "directives": [d], "old_messages": [], "new_messages": []}, 400, None),
        (dirs, {"model": "other", "tokens": T, "directives": [d]}, 404, "model"),
        (dirs, {"old_messages": [{"role": "user", "content": "a"}], "new_messages": [{"role": "robot", "content": "a"}]}, 400, "new_messages[0].role"),
        (dirs, {"tokens": T, "directives": [d], "surprise": 1}, 400, "surprise"),
        ("/v1/completions", {**ok_cmpl, "prompt": [1, 99999]}, 400, "prompt[1]"),
        ("/v1/completions", {**ok_cmpl, "prompt": []}, 400, "prompt"),
        ("/v1/completions", {**ok_cmpl, "temperature": "hot"}, 400, "temperature"),
        ("/v1/completions", {**ok_cmpl, "max_tokens": 0}, 400, "max_tokens"),
        ("/v1/completions", {**ok_cmpl, "max_tokens": 10**7}, 400, "max_tokens"),
        ("/v1/completions", {**ok_cmpl, "n": 2}, 400, "n"),
        ("/v1/completions", {**ok_cmpl, "model": "nope"}, 404, "model"),
        ("/v1/completions", {**ok_cmpl, "stop": [""]}, 400, "stop[0]"),
        ("/v1/completions", {**ok_cmpl, "logprobs": 50}, 400, "logprobs"),
        ("/v1/completions", {**ok_cmpl, "echo": True}, 400, "echo"),
        ("/v1/chat/completions", {**ok_chat, "messages": []}, 400, "messages"),
        ("/v1/chat/completions", {**ok_chat, "messages": [{"content": "x"}]}, 400, "messages[0].role"),
        ("/v1/chat/completions", {**ok_chat, "top_logprobs": 3}, 400, "top_logprobs"),
        ("/v1/chat/completions", {**ok_chat, "tool_choice": "required"}, 400, "tool_choice"),
        ("/v1/chat/completions", {**ok_chat, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages[0].content"),
        ("/v1/chat/completions", b'{"model": ', 400, "body"),
    ]  # fmt: skip


def test_bad_inputs_get_json_4xx_naming_the_field_and_change_nothing(client, http, name):
    T, X = random_ids(21, 36), random_ids(22, 3)
    _complete(client, name, T, 1)

    def probe():
        r, c = _complete(client, name, T + X, 3)
        return r.usage.prompt_tokens_details.cached_tokens, c.text, c.logprobs.token_logprobs

    probe()
    before, stats = probe(), http.get("/leyline/v1/stats").json()
    for path, body, status, field in _bad_requests(name, T):
        kw = (
            {"content": body, "headers": {"content-type": "application/json"}}
            if isinstance(body, bytes)
            else {"json": body}
        )
        r = http.post(path, **kw)
        assert r.status_code == status, (path, body, r.text)
        err = r.json()["error"]
        assert set(err) == {"type", "leyline_type", "message", "param", "code", "field"} and err["message"], err
        assert err["param"] == err["field"] and err["code"], err
        if field is not None:
            assert (err["field"] or "").startswith(field), (field, err)
            assert field.split("[")[0].split(".")[0] in err["message"], err
    assert http.get("/nowhere").status_code == 404
    types = {
        f: http.post(p, json=b).json()["error"]["leyline_type"] for p, b, _, f in _bad_requests(name, T)[:3]
    }
    assert types == {
        "directives[0].end": "DirectiveError",
        "directives[1]": "DirectiveError",
        "directives[0].mode": "UnsupportedModeError",
    }
    assert http.get("/leyline/v1/stats").json() == stats
    assert probe() == before  # the cache is as it was: same hit, bitwise the same logprobs

    # a base that is not cached: 409, counted as a directive error (and only that)
    stats = http.get("/leyline/v1/stats").json()
    U = random_ids(23, 20)
    miss = http.post(
        "/leyline/v1/directives", json={"tokens": U, "directives": [{"start": 2, "end": 4}]}
    )
    assert miss.status_code == 409 and miss.json()["error"]["leyline_type"] == "CacheMissError", miss.text
    assert http.get("/leyline/v1/stats").json() == {
        **stats,
        "directive_errors": stats["directive_errors"] + 1,
    }
    assert probe()[1:] == before[1:]


def _listening_addresses(port: int) -> set[str]:
    """Addresses with a socket in LISTEN state on ``port``, read from the kernel's tables."""
    found = set()
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            addr, p = local.split(":")
            if int(p, 16) == port and state == "0A":
                if width == 8:
                    found.add(".".join(str(b) for b in reversed(bytes.fromhex(addr))))
                else:
                    found.add("v6:" + addr)
    return found


def test_leyline_serve_binds_loopback_by_default(model_dir):
    from leyline_agent.cli import build_parser
    from leyline_agent.server.main import build_server
    from leyline_agent.testing.server import free_port

    port = free_port()
    args = build_parser().parse_args(
        ["serve", "--model", str(model_dir), "--port", str(port), "--device", "cpu"]
    )
    server = build_server(args)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_ready(f"http://127.0.0.1:{port}", 60, alive=thread.is_alive)
        assert _listening_addresses(port) == {"127.0.0.1"}
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()
        assert [m["id"] for m in models["data"]] == [model_dir.name]
    finally:
        server.should_exit = True
        thread.join(30)
    assert not thread.is_alive()


def test_the_agent_side_http_runtime_talks_to_the_server(client, name, server):
    """``HTTPRuntime`` (agent side) gets answers and the same error classes back."""
    from leyline_agent.agent.http_runtime import HTTPRuntime, NoLeylineRoutesError
    from leyline_agent.errors import CacheMissError, DirectiveError

    T = random_ids(31, 30)
    _complete(client, name, T, 1)
    rt = HTTPRuntime(server.base_url, retries=1)
    try:
        d = {"start": 4, "end": 9, "replacement": [11, 12], "mode": "amortize"}
        resp = rt.apply_directives(DirectivesRequest(tokens=T, directives=[d]))
        assert resp.tokens == T[:4] + [11, 12] + T[9:] and resp.splices["amortize"] == 1
        with pytest.raises(CacheMissError):
            rt.apply_directives(DirectivesRequest(tokens=random_ids(32, 10), directives=[d]))
        assert rt.stats().splices["amortize"] >= 1
        # A wrong model name is a bad field, not a server without Leyline routes.
        with pytest.raises(DirectiveError, match="model") as e:
            rt.apply_directives(DirectivesRequest(model="no-such-model", tokens=T, directives=[d]))
        assert not isinstance(e.value, NoLeylineRoutesError)
    finally:
        rt.close()
