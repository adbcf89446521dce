"""The real Codex CLI (``codex exec`` on its defaults plus only the provider config) against
``vllm serve`` with the Leyline plugin: vLLM's own Responses API serves Codex's requests
(``reasoning``, ``include``, ``store: false``, ``prompt_cache_key``, ``namespace`` and
``web_search`` tools, ``function_call`` / ``function_call_output`` items), the plugin's guard
in front of it.

The model is the tiny llama with its sampled tokens chosen by a script
(``testing.vllm_script.ScriptedLogits``, a vLLM logits processor: a random-weight model writes
no tool calls), parsed by vLLM's ``hermes`` tool parser: two shell commands through Codex's
``exec_command`` tool, then an answer (``testing.codex.SCRIPT``, the script the
``leyline serve`` test plays). Checks: Codex exits 0; the server's access log shows at least
3 ``/v1/responses`` requests and every request a 200; the first command's output came back
into a later prompt (the prompts as the engine saw them); vLLM's prefix cache served part of
the later turns (its ``/metrics``).
"""

from __future__ import annotations

import json
import re

import httpx
from prometheus_client.parser import text_string_to_metric_families

from leyline_agent.engine.checkpoints.store import tiny_model_dir
from leyline_agent.testing.codex import FINAL, PROBE, SCRIPT, run_codex
from leyline_agent.testing.server import serve_vllm
from leyline_agent.testing.vllm_script import PROMPTS_ENV, SCRIPT_ENV

from .conftest import BLOCK

ARGS = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes",
        "--logits-processors", "leyline_agent.testing.vllm_script:ScriptedLogits"]  # fmt: skip
ACCESS = re.compile(r'"(GET|POST|PUT|DELETE|PATCH|HEAD|OPTIONS) (\S+) HTTP/[\d.]+" (\d{3})')


def _prefix_hits(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    return sum(
        s.value for f in text_string_to_metric_families(text)
        for s in f.samples if s.name == "vllm:prefix_cache_hits_total"
    )  # fmt: skip


def test_codex_exec_against_vllm_serve_with_the_plugin(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    env = {SCRIPT_ENV: json.dumps(SCRIPT), PROMPTS_ENV: str(prompts)}
    with serve_vllm(
        tiny_model_dir("llama"), block_size=BLOCK, max_model_len=32768, extra_args=ARGS, env=env
    ) as srv:  # Codex's instructions and tools alone are about 4k tokens of this tokenizer
        assert httpx.get(srv.url + "/leyline/v1/stats", timeout=30).status_code == 200  # plugin on
        run = run_codex(srv.base_url, srv.model, tmp_path)
        hits = _prefix_hits(srv.url)
        log = srv.log_tail(10**7)
    assert run.returncode == 0, (run.stderr[-3000:], log[-3000:])
    assert FINAL in run.stdout
    answers = [(m[2], int(m[3])) for m in ACCESS.finditer(log)]
    turns = [s for path, s in answers if path == "/v1/responses"]
    assert len(turns) >= 3, answers
    assert all(s == 200 for _, s in answers), answers
    seen = [json.loads(line) for line in prompts.read_text().splitlines()]
    assert any(PROBE in p.split("echo " + PROBE, 1)[-1] for p in seen[1:])  # ran, output back
    assert hits > 0  # the later turns reused the cached prefix
