"""Anthropic's Messages API alike on both servers, through the real ``anthropic`` SDK.

Each server answers ``messages.create`` (streamed and not) and ``count_tokens`` for the same
prompt with the same counts, and a scripted 6-turn tool loop with ``clear_tool_uses_20250919``
(keep 2) reports the same ``applied_edits``, makes at least 3 AMORTIZE splices (counted in
``/leyline/v1/stats``) and prefills at most 1.10x the tokens of the same loop without edits
(the prompt's uncached part plus what the splices prefilled, per turn).
"""

from __future__ import annotations

import json

import anthropic

from leyline_agent.testing.messages_loops import prefilled, think_loop

from .conftest import KEY

TOOL = {"name": "read_file", "description": "read a file",
        "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}  # fmt: skip
CLEAR = {"edits": [{"type": "clear_tool_uses_20250919",
                    "trigger": {"type": "input_tokens", "value": 1},
                    "keep": {"type": "tool_uses", "value": 2}}]}  # fmt: skip
GREEDY = {"temperature": 0}  # the SDK no longer takes temperature


def sdk(srv, as_header: bool = True) -> anthropic.Anthropic:
    """The SDK with the key as Anthropic's ``x-api-key`` header alone, or as ``api_key=``
    alone (which the pinned SDK sends as ``Authorization: Bearer``)."""
    auth = {"default_headers": {"X-Api-Key": KEY}} if as_header else {"api_key": KEY}
    return anthropic.Anthropic(base_url=srv.url, max_retries=0, timeout=300, **auth)


def loop(client, srv, salt: str, cm=None) -> list[tuple[object, int]]:
    msgs = [{"role": "user", "content": f"Inspect the files {salt} and report."}]
    out = []
    for k in range(6):
        extra = {"context_management": cm} if cm else {}
        m = client.beta.messages.create(
            model=srv.model, max_tokens=4, system=f"You are a careful agent {salt}.",
            messages=msgs, tools=[TOOL], tool_choice={"type": "none"}, extra_body=GREEDY,
            betas=["context-management-2025-06-27"], extra_headers={"X-Leyline-Session": salt},
            **extra,
        )  # fmt: skip
        out.append((m, prefilled(m)))
        text = "".join(b.text for b in m.content if b.type == "text")
        use = {"type": "tool_use", "id": f"toolu_{salt}{k}", "name": "read_file",
               "input": {"path": f"f{k}.py"}}  # fmt: skip
        result = {"type": "tool_result", "tool_use_id": use["id"],
                  "content": " ".join(f"{salt}line{k}_{j} value={j * k}" for j in range(24))}  # fmt: skip
        msgs = [*msgs, {"role": "assistant", "content": [{"type": "text", "text": text}, use]},
                {"role": "user", "content": [result]}]  # fmt: skip
    return out


def test_messages_and_count_tokens_alike(both):
    views = []
    for srv in both:
        client = sdk(srv)
        kw = {"model": srv.model, "max_tokens": 4, "system": "Be brief.", "extra_body": GREEDY,
              "messages": [{"role": "user", "content": "Name a colour."}]}  # fmt: skip
        m = client.messages.create(**kw)
        again = sdk(srv, as_header=False).messages.create(**kw)
        assert again.content == m.content, srv.name
        with client.messages.stream(**kw) as s:
            final = s.get_final_message()
        count = client.messages.count_tokens(
            model=srv.model, system="Be brief.", messages=kw["messages"]
        )
        total = m.usage.input_tokens + m.usage.cache_read_input_tokens
        assert total == count.input_tokens, srv.name
        assert final.usage.input_tokens + final.usage.cache_read_input_tokens == total
        assert final.stop_reason == m.stop_reason and m.stop_reason in ("end_turn", "max_tokens")
        views.append((count.input_tokens, m.usage.output_tokens))
    assert views[0] == views[1]


def edited_vs_plain(srv, what: str, run, cm) -> list:
    """``run(salt suffix, context_management)`` with ``cm`` and without: at least 3 AMORTIZE
    splices, and at most 1.10x the unedited run's prefill; the edited run's messages."""
    before = srv.stats()["splices"]["amortize"]
    edited = run("e", cm)
    spliced = srv.stats()["splices"]["amortize"] - before
    plain = run("p", None)
    assert spliced >= 3, (srv.name, what, spliced)
    total_edited, total_plain = sum(p for _, p in edited), sum(p for _, p in plain)
    print(f"{srv.name}, {what}: prefilled {total_edited} vs {total_plain} "
          f"unedited = {total_edited / total_plain:.3f}x, {spliced} splices")  # fmt: skip
    assert total_edited <= 1.10 * total_plain, (srv.name, what, total_edited, total_plain)
    return [m for m, _ in edited]


def test_clear_tool_uses_is_spliced_alike(both):
    edits = {}
    for srv in both:
        client, salt = sdk(srv), f"msg{both[1].block}{srv.name}"

        def run(suffix, cm, client=client, srv=srv, salt=salt):
            return loop(client, srv, salt + suffix, cm)

        edited = edited_vs_plain(srv, f"clear_tool_uses (block {both[1].block})", run, CLEAR)
        edits[srv.name] = [
            [(e.type, e.cleared_tool_uses) for e in m.context_management.applied_edits]
            for m in edited
        ]
    assert edits["leyline"] == edits["vllm"]
    assert edits["leyline"][5] == [("clear_tool_uses_20250919", 3)]


def test_clear_thinking_is_spliced_alike(both):
    """``clear_thinking_20251015`` (keep 1): the earlier turn's thinking block (a ``<think>``
    span the template renders) is cleared and spliced on both servers alike."""
    views = {}
    for srv in both:
        client, salt = sdk(srv), f"think{both[1].block}{srv.name}"

        def turn(think: str, text: str) -> dict:
            return {"role": "assistant", "content": [
                {"type": "thinking", "thinking": think, "signature": ""},
                {"type": "text", "text": text}]}  # fmt: skip

        first = [{"role": "user", "content": f"Pick an option {salt}."},
                 turn("First I weigh options one, two and three carefully.", "Option one."),
                 {"role": "user", "content": "Sure?"}]  # fmt: skip
        kw = {"model": srv.model, "max_tokens": 2, "extra_body": GREEDY,
              "betas": ["context-management-2025-06-27"],
              "extra_headers": {"X-Leyline-Session": salt}}  # fmt: skip
        client.beta.messages.create(messages=first, **kw)
        before = srv.stats()["splices"]["amortize"]
        msgs = [*first, turn("Now option two looks best.", "Option two."),
                {"role": "user", "content": "Why?"}]  # fmt: skip
        cm = {"edits": [{"type": "clear_thinking_20251015",
                         "keep": {"type": "thinking_turns", "value": 1}}]}  # fmt: skip
        m = client.beta.messages.create(messages=msgs, context_management=cm, **kw)
        (edit,) = m.context_management.applied_edits
        spliced = srv.stats()["splices"]["amortize"] - before
        assert spliced >= 1, srv.name
        views[srv.name] = (edit.type, edit.cleared_thinking_turns, edit.cleared_input_tokens,
                           m.usage.input_tokens + m.usage.cache_read_input_tokens)  # fmt: skip
    assert views["leyline"] == views["vllm"]
    assert views["leyline"][:2] == ("clear_thinking_20251015", 1)


def test_hints_are_listed_alike(both):
    """Anthropic's hints (``service_tier``, ``metadata.user_id``, ``cache_control`` on the
    request and on a block) are listed in ``leyline.ignored`` by path on both servers, in the
    Message, in the stream's ``message_delta`` and by ``count_tokens`` (its block's mark)."""
    body = {"max_tokens": 2, "temperature": 0, "service_tier": "auto",
            "metadata": {"user_id": "u"}, "cache_control": {"type": "ephemeral"},
            "messages": [{"role": "user", "content": [
                {"type": "text", "text": "Name a colour.", "cache_control": {"type": "ephemeral"}}]}]}  # fmt: skip
    want = ["service_tier", "cache_control", "metadata.user_id",
            "messages[0].content[0].cache_control"]  # fmt: skip
    for srv in both:
        r = srv.post("/v1/messages", {**body, "model": srv.model})
        assert r.status_code == 200, (srv.name, r.text)
        assert sorted(n["field"] for n in r.json()["leyline"]["ignored"]) == sorted(want), srv.name
        r = srv.post("/v1/messages", {**body, "model": srv.model, "stream": True})
        assert r.status_code == 200, (srv.name, r.text)
        (delta,) = [json.loads(ln[6:]) for ln in r.text.splitlines()
                    if ln.startswith("data: ") and '"message_delta"' in ln]  # fmt: skip
        assert sorted(n["field"] for n in delta["leyline"]["ignored"]) == sorted(want), srv.name
        counted = {k: v for k, v in body.items() if k in ("messages", "system", "tools")}
        r = srv.post("/v1/messages/count_tokens", {**counted, "model": srv.model})
        assert r.status_code == 200, (srv.name, r.text)
        fields = sorted(n["field"] for n in r.json()["leyline"]["ignored"])
        assert fields == ["messages[0].content[0].cache_control"], srv.name


def test_clear_thinking_loop_is_spliced_alike(both):
    """``clear_thinking_20251015`` (keep 1) over 6 turns on both servers: the same
    ``applied_edits``, at least 3 AMORTIZE splices, prefill at most 1.10x the unedited loop."""
    cm = {"edits": [{"type": "clear_thinking_20251015",
                     "keep": {"type": "thinking_turns", "value": 1}}]}  # fmt: skip
    edits = {}
    for srv in both:
        client, salt = sdk(srv), f"tl{both[1].block}{srv.name}"

        def run(suffix, cm, client=client, srv=srv, salt=salt):
            def send(msgs):
                return client.beta.messages.create(
                    model=srv.model, max_tokens=3, messages=msgs, extra_body=GREEDY,
                    betas=["context-management-2025-06-27"],
                    extra_headers={"X-Leyline-Session": salt + suffix},
                    **({"context_management": cm} if cm else {}),
                )  # fmt: skip

            return think_loop(send, salt + suffix)

        edited = edited_vs_plain(srv, f"clear_thinking (block {both[1].block})", run, cm)
        edits[srv.name] = [[(e.type, e.cleared_thinking_turns)
                            for e in m.context_management.applied_edits] for m in edited]  # fmt: skip
    assert edits["leyline"] == edits["vllm"]
    assert edits["leyline"][5] == [("clear_thinking_20251015", 4)]
