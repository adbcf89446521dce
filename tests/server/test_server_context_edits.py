"""Server-side context editing over HTTP: ``context_management``, client edits, conversations.

A real ``leyline serve`` app (tiny random-weight model) on loopback, driven by the plain
``openai`` client with no wrapper. The tool loop is scripted so it does not depend on what
the model says: each turn the client echoes the model's text and attaches a scripted tool
call, then the tool's (long) output. Expected prompts are built here, independently, and
rendered with the tokenizer's own chat template.
"""

from __future__ import annotations

import threading

import httpx
import openai
import pytest

from leyline_agent.engine.checkpoints.store import tiny_model_dir
from leyline_agent.testing.server import serve_in_thread

pytestmark = pytest.mark.slow

ARCH = "deepseek_v2"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "read a file",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    }
]
STUB = "[stale output of read_file elided]"  # StaleToolTruncation's default placeholder


def output(k: int, salt: str = "") -> str:
    return " ".join(f"{salt}line{k}_{j} value={j * k}" for j in range(40))


@pytest.fixture(scope="module")
def model_dir():
    return tiny_model_dir(ARCH)


@pytest.fixture(scope="module")
def tok(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def _serve(model_dir, client_edits):
    from leyline_agent.engine.engine import Engine
    from leyline_agent.server.app import create_app

    return serve_in_thread(create_app(Engine.from_pretrained(model_dir), client_edits=client_edits))


@pytest.fixture(scope="module")
def amortize_server(model_dir):
    with _serve(model_dir, "amortize") as srv:
        yield srv


@pytest.fixture(scope="module")
def off_server(model_dir):
    with _serve(model_dir, "off") as srv:
        yield srv


def client_of(srv, **kw):
    return openai.OpenAI(base_url=srv.base_url, api_key="none", max_retries=0, timeout=300, **kw)


def stats(srv):
    return httpx.get(f"{srv.url}/leyline/v1/stats", timeout=60).json()


def rendered(tok, messages) -> list[int]:
    out = tok.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=True)
    return list(out if isinstance(out, list) else out["input_ids"])


def n_tokens(tok, text: str) -> int:
    return len(tok.encode(text, add_special_tokens=False))


def stubbed(history, keep: int):
    """Tool results older than the newest ``keep`` tool turns replaced by the stub."""
    turns = [i for i, m in enumerate(history) if m["role"] == "assistant" and m.get("tool_calls")]
    stale = set(turns[: max(0, len(turns) - keep)])
    out = []
    for m in history:
        if m["role"] == "tool":
            owner = max(i for i in turns if i < history.index(m))
            if owner in stale:
                m = {**m, "content": STUB}
        out.append(m)
    return out


def tool_loop(client, model, turns, *, body=None, client_keep=None, salt="", headers=None):
    """Run the scripted loop; return per-turn (response, history sent)."""
    history = [
        {"role": "system", "content": f"You are a careful agent {salt}."},
        {"role": "user", "content": f"Inspect the files {salt} and report."},
    ]
    out = []
    for k in range(turns):
        sent = stubbed(history, client_keep) if client_keep else history
        r = client.chat.completions.create(
            model=model,
            messages=sent,
            tools=TOOLS,
            max_tokens=6,
            temperature=0,
            extra_body=body,
            extra_headers=headers,
        )
        out.append((r, [dict(m) for m in sent]))
        text = r.choices[0].message.content or ""
        call = {
            "id": f"call_{salt}{k}",
            "type": "function",
            "function": {"name": "read_file", "arguments": f'{{"path": "f{k}.py"}}'},
        }
        history = [
            *history,
            {"role": "assistant", "content": text, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": output(k, salt)},
        ]
    return out


CM = {"edits": [{"type": "clear_tool_uses", "trigger": {"type": "input_tokens", "value": 1},
                 "keep": {"type": "tool_uses", "value": 2}}]}  # fmt: skip


def test_context_management_clears_and_splices(amortize_server, tok, model_dir):
    client = client_of(amortize_server)
    before = stats(amortize_server)
    runs = tool_loop(client, model_dir.name, 10, body={"context_management": CM})
    after = stats(amortize_server)
    conversations = {r.model_extra["leyline"]["conversation"] for r, _ in runs}
    assert len(conversations) == 1
    for t, (r, sent) in enumerate(runs):
        expected = stubbed(sent, 2)
        assert r.usage.prompt_tokens == len(rendered(tok, expected)), t
        cleared = max(0, t - 2)
        edit = r.model_extra["context_management"]["applied_edits"][0]
        assert edit["type"] == "clear_tool_uses"
        assert edit["cleared_tool_uses"] == cleared
        saved = sum(n_tokens(tok, output(k)) - n_tokens(tok, STUB) for k in range(cleared))
        assert edit["cleared_input_tokens"] == saved
        if t >= 3:  # one more result stubbed this turn: spliced, not re-prefilled
            assert r.model_extra["leyline"]["directives"][0]["splices"]["amortize"] == 1
        if t >= 1:
            # cached: the previous turn's prompt as edited now (the conversation minus what
            # the edits removed), up to the few tokens where the echoed reply's rendering
            # differs from the generated one; prefilled: only what this turn appended
            older = len(rendered(tok, expected[:-2]))
            cached = r.usage.prompt_tokens_details.cached_tokens
            assert older - 16 <= cached <= older + 6, t  # + the reply's 6 tokens
    assert after["splices"]["amortize"] - before["splices"]["amortize"] == 7
    assert after["fallbacks"] == before["fallbacks"]


def _common(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.parametrize("arm", ["amortize", "off"])
def test_client_made_stubs(arm, amortize_server, off_server, tok, model_dir):
    srv = amortize_server if arm == "amortize" else off_server
    client = client_of(srv)
    before = stats(srv)
    runs = tool_loop(client, model_dir.name, 6, client_keep=2, salt=arm)
    after = stats(srv)
    spliced = after["splices"]["amortize"] - before["splices"]["amortize"]
    for t, (r, sent) in enumerate(runs):
        assert r.usage.prompt_tokens == len(rendered(tok, sent))  # what the client sent
        if arm == "off" and t >= 3:
            # exact: everything from the first token that differs from the cached
            # conversation (last prompt + the reply as generated) is prefilled again
            prev_r, prev_sent = runs[t - 1]
            cached_seq = rendered(tok, prev_sent) + tok.encode(
                prev_r.choices[0].message.content or "", add_special_tokens=False
            )
            now = rendered(tok, sent)
            prefilled = r.usage.prompt_tokens - r.usage.prompt_tokens_details.cached_tokens
            assert prefilled >= len(now) - _common(cached_seq, now)
            assert "leyline" not in r.model_extra
        if arm == "amortize" and t >= 3:
            lm = r.model_extra["leyline"]
            assert lm["edited_messages"] == [2 * (t - 2) + 1]  # the newly stubbed result
            assert r.usage.model_extra["leyline"]["splices"]["amortize"] == 1
    assert spliced == (3 if arm == "amortize" else 0)


def test_three_concurrent_conversations_on_one_client(amortize_server, model_dir):
    client = client_of(amortize_server)
    results: dict[int, list] = {}
    errors = []
    start = threading.Barrier(3)

    def run(i):
        try:
            start.wait()
            results[i] = tool_loop(client, model_dir.name, 5, client_keep=2, salt=f"c{i}")
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    ids = []
    for i in range(3):
        convs = {r.model_extra["leyline"]["conversation"] for r, _ in results[i]}
        assert len(convs) == 1, convs  # never reset, never mixed
        ids.append(convs.pop())
        splices = [r.usage.model_extra["leyline"]["splices"]["amortize"] for r, _ in results[i]]
        assert splices == [0, 0, 0, 1, 1]
    assert len(set(ids)) == 3


def test_named_session_and_other_conversations_never_match(amortize_server, model_dir):
    client = client_of(amortize_server)
    first = tool_loop(client, model_dir.name, 2, salt="p")
    anon = first[-1][0].model_extra["leyline"]["conversation"]
    named = tool_loop(client, model_dir.name, 2, salt="p", headers={"X-Leyline-Session": "mine"})
    for r, _ in named:
        lm = r.model_extra["leyline"]
        assert lm["session"] == "mine" and lm["conversation"] != anon
    other = tool_loop(client, model_dir.name, 1, salt="q")
    assert other[0][0].model_extra["leyline"]["conversation"] != anon


# fmt: off
BAD = [
    ({"context_management": {"edits": [{"type": "clear_tool_uses", "keep": {"type": "tool_uses", "value": 0}}]}}, "context_management.edits[0].keep.value"),
    ({"context_management": {"edits": [{"type": "clear_tool_uses", "trigger": {"type": "tokens", "value": 5}}]}}, "context_management.edits[0].trigger.type"),
    ({"context_management": {"edits": [{"type": "clear_tool_uses", "clear_tool_inputs": ["x"]}]}}, "context_management.edits[0].clear_tool_inputs"),
    ({"context_management": {"edits": [{"type": "clear_tool_uses", "exclude": []}]}}, "context_management.edits[0].exclude"),
    ({"context_management": {"edits": [{"type": "shrink"}]}}, "context_management.edits[0].type"),
    ({"context_management": {"edit": []}}, "context_management.edit"),
    ({"context_management": []}, "context_management"),
    ({"context_management": {"edits": [{"type": "stale_tool", "keep": -1}]}}, "context_management.edits[0].keep"),
    ({"context_management": {"edits": [{"type": "failed_call", "patterns": ["("]}]}}, "context_management.edits[0].patterns"),
    ({"context_management": {"edits": [{"type": "stale_tool", "count_tokens": 1}]}}, "context_management.edits[0].count_tokens"),
    ({"leyline": {"client_edits": "sometimes"}}, "leyline.client_edits"),
    ({"leyline": {"mode": "forget"}}, "leyline.mode"),
    ({"leyline": "off"}, "leyline"),
]
# fmt: on


def test_bad_fields_are_400_naming_them_and_change_nothing(amortize_server, model_dir):
    client = client_of(amortize_server)
    runs = tool_loop(client, model_dir.name, 3, salt="bad")
    r, sent = runs[-1]
    history = [*sent, {"role": "assistant", "content": r.choices[0].message.content}]
    history.append({"role": "user", "content": "go on"})
    before = stats(amortize_server)
    for body, field in BAD:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(
                model=model_dir.name, messages=history, tools=TOOLS, max_tokens=2, extra_body=body
            )
        assert e.value.body["field"] == field, (body, e.value.body)
    assert stats(amortize_server) == before


def test_wrapper_edits_are_spliced_once(amortize_server, model_dir):
    from leyline_agent import wrap_openai

    client = wrap_openai(client_of(amortize_server), policies=[{"name": "stale-tool", "keep": 2}])
    before = stats(amortize_server)
    runs = tool_loop(client, model_dir.name, 5, salt="w")
    after = stats(amortize_server)
    for r, _ in runs:  # the wrapper's edits ride in the body: at most one splice per turn
        lm = r.model_extra.get("leyline") or {"directives": []}
        assert len(lm["directives"]) <= 1, lm
    assert after["splices"]["amortize"] - before["splices"]["amortize"] == 2  # turns 3 and 4
