"""Leyline's Prometheus series alike on both servers: ``leyline serve``'s ``/metrics`` and
``vllm serve``'s (vLLM's own series, then the plugin's).

Each ``/metrics`` is read with ``prometheus_client``'s text parser. A 4-turn tool loop with
``context_management`` (keep 1) splices; the ``context_management`` splice counter must move
by the splices the answers themselves report, and the splice series must add up to
``/leyline/v1/stats``' own count.
"""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

CM = {"edits": [{"type": "clear_tool_uses_20250919", "trigger": {"type": "input_tokens",
       "value": 1}, "keep": {"type": "tool_uses", "value": 1}}]}  # fmt: skip
TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "read a file",
          "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}]  # fmt: skip
SPLICE = ("leyline_splices_total", (("mode", "amortize"), ("source", "context_management")))


def samples(srv) -> dict:
    r = srv.client.get(srv.url + "/metrics")
    assert r.status_code == 200, (srv.name, r.text[:200])
    out = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_metrics_parse_and_splice_counters_move_alike(both):
    moved = {}
    for srv in both:
        salt = f"metrics{both[1].block}{srv.name}"
        before = samples(srv)
        history = [{"role": "user", "content": f"Inspect the files {salt}."}]
        reported = 0
        for k in range(4):
            call = {"id": f"call_{salt}{k}", "type": "function",
                    "function": {"name": "read_file", "arguments": f'{{"path": "f{k}.py"}}'}}  # fmt: skip
            history = [*history, {"role": "assistant", "content": "", "tool_calls": [call]},
                       {"role": "tool", "tool_call_id": call["id"],
                        "content": " ".join(f"{salt}{k}_{j}" for j in range(24))}]  # fmt: skip
            body = {"model": srv.model, "messages": history, "tools": TOOLS, "tool_choice": "none",
                    "max_tokens": 2, "temperature": 0, "context_management": CM}  # fmt: skip
            r = srv.post("/v1/chat/completions", body, session=salt)
            assert r.status_code == 200, (srv.name, r.text)
            reported += sum(d["splices"].get("amortize", 0) for d in r.json()["leyline"]["directives"]
                            if d["kind"] == "context_management")  # fmt: skip
        after = samples(srv)
        assert reported >= 2, srv.name
        assert after[SPLICE] - before.get(SPLICE, 0) == reported, srv.name
        total = sum(v for (n, _), v in after.items() if n == "leyline_splices_total")
        assert total == sum(srv.stats()["splices"].values()), srv.name
        moved[srv.name] = reported
    assert moved["leyline"] == moved["vllm"]
