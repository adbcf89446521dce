"""The agent replay over HTTP, against any OpenAI-compatible endpoint.

The same trajectories, policies and concurrency as ``leyline bench mechanism`` (the
embedded engine, in virtual time), but C sessions really in flight: one thread per session,
each replaying its trajectory turn by turn (``personalize``: its own history, shared system
prompt and tools), its next turn sent as soon as its previous reply came back. Arms:

- ``radix``: the policies edit the history and nothing else: every edit costs a re-prefill
  from the edit point (vanilla ``vllm serve``, llama-server, ``leyline serve``);
- ``splice``: the same edits spliced as AMORTIZE, the way ``wrap_openai`` sends them: in the
  chat request's own ``leyline`` body field where the server lists ``body_edits`` in its
  stats (``leyline serve``, ``vllm serve`` + the plugin: one request per turn), else first
  as directives to ``/leyline/v1/directives`` (``HTTPRuntime``); the session is named on
  every call (``X-Leyline-Session``), so its spliced blocks are its own;
- ``full``: the unedited history (the prefix cache's upper bound).

Per turn: prompt and cached tokens from the response's ``usage`` (a server that does not
report ``cached_tokens`` counts 0), the tokens a splice prefilled (from the directive's
answer, or from the chat answer's ``leyline.directives``), TTFT (the chat request's time to
its first streamed token, not a role-only chunk) and e2e (directive, if any, + chat request).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from leyline_agent.directives import Mode
from leyline_agent.errors import LeylineError

from .replay import personalize
from .trajectories import TrajectoryRecord

__all__ = ["HTTP_ARMS", "HttpSample", "replay_http"]

HTTP_ARMS = ("full", "radix", "splice")


@dataclass(slots=True)
class HttpSample:
    session: int
    turn: int
    prompt_tokens: int
    cached_tokens: int
    directive_prefilled_tokens: int
    ttft_s: float
    e2e_s: float
    directive_s: float


@dataclass(slots=True)
class _Counting:
    """An ``HTTPRuntime`` that remembers what its directives prefilled."""

    inner: Any
    prefilled: int = 0
    splices: int = 0

    def apply_directives(self, request: Any) -> Any:
        resp = self.inner.apply_directives(request)
        self.prefilled += resp.prefilled_tokens
        self.splices += sum(resp.splices.values())
        return resp

    def stats(self) -> Any:
        return self.inner.stats()


@dataclass(slots=True)
class HttpResult:
    samples: list[HttpSample] = field(default_factory=list)
    failures: int = 0
    splices: int = 0
    wall_s: float = 0.0


@dataclass(slots=True)
class _Spliced:
    """The splices a chat answer reports in its ``leyline`` field."""

    prefilled: int = 0
    splices: int = 0
    failures: int = 0

    def read(self, leyline: dict[str, Any]) -> None:
        done = [*(leyline.get("directives") or [])]
        drift = leyline.get("drift") or {}
        if drift.get("spliced"):
            done.append({"prefilled_tokens": drift.get("prefilled_tokens", 0), "splices": {"d": 1}})
        for d in done:
            self.prefilled += d.get("prefilled_tokens", 0)
            self.splices += sum((d.get("splices") or {}).values())
            self.failures += d.get("outcome") == "error"


def _chat(
    client: Any, model: str, messages: list, tools: list, headers: dict, max_tokens: int,
    leyline: dict[str, Any] | None = None,
):  # fmt: skip
    """One streamed chat request: ``(text, prompt, cached, ttft, e2e, Spliced)``: what the
    answer's ``leyline`` says its splices did (its directives, and its drift)."""
    t0 = time.perf_counter()
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        tools=tools or None,
        max_tokens=max_tokens,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
        extra_headers=headers,
        extra_body={"leyline": leyline} if leyline else None,
    )
    ttft, text, usage, spliced = None, [], None, _Spliced()
    for chunk in stream:
        spliced.read((chunk.model_extra or {}).get("leyline") or {})
        for c in chunk.choices or []:
            # the first token (a server may send the role alone first, before any compute)
            if ttft is None and (c.delta.content or c.delta.tool_calls or c.finish_reason):
                ttft = time.perf_counter() - t0
            text.append(c.delta.content or "")
        if chunk.usage is not None:
            usage = chunk.usage
    e2e = time.perf_counter() - t0
    prompt = usage.prompt_tokens if usage else 0
    details = getattr(usage, "prompt_tokens_details", None) if usage else None
    cached = (getattr(details, "cached_tokens", 0) or 0) if details else 0
    return "".join(text), prompt, cached, ttft if ttft is not None else e2e, e2e, spliced


def _session(
    base_url: str, model: str, arm: str, traj: TrajectoryRecord, sid: int, policies: list,
    max_turns: int | None, max_tokens: int, out: HttpResult, lock: threading.Lock,
) -> None:  # fmt: skip
    import openai

    from leyline_agent.agent.http_runtime import HTTPRuntime
    from leyline_agent.agent.session import ContextSession
    from leyline_agent.agent.wrappers import rides_in_body

    client = openai.OpenAI(base_url=base_url, api_key="-", max_retries=0, timeout=600)
    name = f"bench-{arm}-{sid}-{time.monotonic_ns()}"
    runtime = _Counting(HTTPRuntime(base_url, timeout=600)) if arm == "splice" else None
    rides = runtime is not None and runtime.inner.has_leyline() and rides_in_body(runtime.inner)
    session = (
        None
        if arm == "full"
        else ContextSession(policies, runtime, mode=Mode.AMORTIZE, session_id=name)
    )
    headers = {"X-Leyline-Session": name} if arm == "splice" else {}
    for turn, a in enumerate(traj.request_points(max_turns)):
        history = traj.messages[:a]
        t0 = time.perf_counter()
        before = runtime.prefilled if runtime else 0
        field = None
        if session is None:
            to_send = history
        elif runtime is None:
            to_send = session.plan(history, traj.tools).messages_to_send
        elif rides:  # one request per turn: the edits ride in the chat body
            plan = session.plan(history, traj.tools, model)
            to_send, field = plan.messages_to_send, session.leyline_field(plan)
        else:
            to_send = session.prepare(history, traj.tools, model)
        directive_s = time.perf_counter() - t0
        text, prompt, cached, ttft, e2e, spliced = _chat(
            client, model, to_send, traj.tools, headers, max_tokens, field
        )
        if session is not None:
            session.observe_reply({"role": "assistant", "content": text})
        prefilled = (runtime.prefilled - before) + spliced.prefilled if runtime else 0
        with lock:
            out.samples.append(HttpSample(
                sid, turn, prompt, cached, prefilled, ttft, directive_s + e2e, directive_s,
            ))  # fmt: skip
            out.splices += spliced.splices
            out.failures += spliced.failures
    with lock:
        if session is not None:
            out.failures += session.stats.runtime_failures
        out.splices += runtime.splices if runtime else 0


def replay_http(
    base_url: str,
    model: str,
    arm: str,
    trajectories: list[TrajectoryRecord],
    *,
    concurrency: int,
    sessions: int,
    policies_factory: Any,
    max_turns: int | None,
    max_tokens: int = 1,
) -> HttpResult:
    """``sessions`` sessions (trajectory ``i % len``), ``concurrency`` in flight."""
    if arm not in HTTP_ARMS:
        raise LeylineError(f"--arms: {arm!r} over HTTP; known: {', '.join(HTTP_ARMS)}")
    out, lock = HttpResult(), threading.Lock()
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        futures = [
            pool.submit(
                _session,
                base_url,
                model,
                arm,
                personalize(trajectories[sid % len(trajectories)], sid),
                sid,
                policies_factory(),
                max_turns,
                max_tokens,
                out,
                lock,
            )  # fmt: skip
            for sid in range(sessions)
        ]
        for f in futures:
            f.result()
    out.wall_s = time.perf_counter() - t0
    return out
