"""Operations over real HTTP: Prometheus ``/metrics``, ``X-Request-Id``, the access log, and
``--json-logs`` / ``--log-level`` after ``serve``.

``/metrics`` is read with ``prometheus_client``'s own text parser; its splice counters are
compared with the splices the answers themselves report. The access log is read from a real
``leyline serve`` process's output: every line must parse as JSON, and each request id must
be on exactly one access line.
"""

from __future__ import annotations

import json

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from leyline_agent.testing.server import serve_in_process, serve_in_thread

pytestmark = pytest.mark.slow

ARCH = "llama"
CM = {"edits": [{"type": "clear_tool_uses_20250919", "trigger": {"type": "input_tokens",
       "value": 1}, "keep": {"type": "tool_uses", "value": 1}}]}  # fmt: skip


@pytest.fixture(scope="module")
def server(model_dir):
    from leyline_agent.engine.engine import Engine
    from leyline_agent.server.app import create_app

    with serve_in_thread(
        create_app(Engine.from_pretrained(model_dir), client_edits="amortize")
    ) as srv:
        yield srv


def samples(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    r = httpx.get(f"{url}/metrics", timeout=60)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def tool_turns(name: str, turns: int) -> list[list[dict]]:
    history = [{"role": "user", "content": "Inspect the files and report."}]
    out = []
    for k in range(turns):
        call = {"id": f"call_{k}", "type": "function",
                "function": {"name": "read_file", "arguments": f'{{"path": "f{k}.py"}}'}}  # fmt: skip
        history = [
            *history,
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"],
             "content": " ".join(f"line{k}_{j}" for j in range(40))},
        ]  # fmt: skip
        out.append(list(history))
    return out


def test_metrics_parse_and_splice_counters_move_with_a_splice(server, name):
    splice = ("leyline_splices_total", (("mode", "amortize"), ("source", "context_management")))
    before = samples(server.url)
    reported = 0
    for messages in tool_turns(name, 3):
        body = {"model": name, "messages": messages, "max_tokens": 2, "temperature": 0,
                "context_management": CM}  # fmt: skip
        r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        reported += sum(
            d["splices"].get("amortize", 0) for d in r.json()["leyline"]["directives"]
            if d["kind"] == "context_management"
        )  # fmt: skip
    after = samples(server.url)
    assert reported >= 1
    assert after[splice] - before.get(splice, 0) == reported
    stats = httpx.get(f"{server.url}/leyline/v1/stats", timeout=60).json()
    total = sum(v for (n, labels), v in after.items() if n == "leyline_splices_total")
    assert total == sum(stats["splices"].values())
    assert after[("leyline_prefilled_tokens_total", ())] == stats["prefilled_tokens"]
    assert after[("leyline_cached_tokens_total", ())] == stats["cached_tokens"]
    route = (("method", "POST"), ("route", "/v1/chat/completions"), ("status", "200"))
    assert (
        after[("leyline_http_requests_total", route)]
        - before.get(("leyline_http_requests_total", route), 0)
        == 3
    )
    ttft = ("leyline_time_to_first_token_seconds_count", ())
    assert after[ttft] - before.get(ttft, 0) == 3


def test_request_id_is_honoured_or_made(server):
    r = httpx.get(f"{server.url}/v1/models", headers={"X-Request-Id": "abc-123.x"}, timeout=30)
    assert r.headers["x-request-id"] == "abc-123.x"
    made = httpx.get(f"{server.url}/v1/models", timeout=30).headers["x-request-id"]
    bad = httpx.get(f"{server.url}/v1/models", headers={"X-Request-Id": "a b"}, timeout=30)
    assert len(made) == 32 and bad.headers["x-request-id"] not in ("a b", made)


def test_access_log_lines_are_json_one_per_request(model_dir, name, tmp_path):
    log = tmp_path / "serve.log"
    ids = {}
    with serve_in_process(model_dir, "--log-level", "info", "--json-logs", log_path=log) as srv:
        ids["models"] = ("GET", "/v1/models", 200)
        httpx.get(f"{srv.url}/v1/models", headers={"X-Request-Id": "models"}, timeout=30)
        ids["chat"] = ("POST", "/v1/chat/completions", 200)
        body = {"model": name, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
        r = httpx.post(f"{srv.url}/v1/chat/completions", json=body,
                       headers={"X-Request-Id": "chat", "X-Leyline-Session": "s1"}, timeout=120)  # fmt: skip
        assert r.status_code == 200
        ids["bad"] = ("POST", "/v1/chat/completions", 400)
        httpx.post(f"{srv.url}/v1/chat/completions", json={"model": name},
                   headers={"X-Request-Id": "bad"}, timeout=30)  # fmt: skip
        made = httpx.get(f"{srv.url}/nowhere", timeout=30).headers["x-request-id"]
        ids[made] = ("GET", "-", 404)
    lines = [ln for ln in log.read_text().splitlines() if ln.strip()]
    records = [json.loads(ln) for ln in lines]  # every line is JSON
    access = [r for r in records if r.get("event") == "request"]
    for rid, (method, route, status) in ids.items():
        (line,) = [r for r in access if r["request_id"] == rid]
        assert (line["method"], line["route"], line["status"]) == (method, route, status)
        assert {"duration_ms", "tenant", "session", "path"} <= set(line)
    chat = next(r for r in access if r["request_id"] == "chat")
    assert chat["session"] == "s1" and chat["tenant"] == ""  # no keys: the one tenant
    assert any(r.get("logger", "").startswith("uvicorn") for r in records)  # uvicorn's too
