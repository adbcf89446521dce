"""The arms of ``leyline check quality``: ways to serve a question after a stale output is edited.

An arm is a name and one function, ``history(server, case) -> token ids``: it puts the
server's cache into the arm's state for ``case`` (through the HTTP API only) and returns the
token ids the question follows. The harness then sends ``history + question`` (and, for a
fact case, the answer's tokens one at a time) to the same server, so every arm's logits
come from the same engine, the same weights and the same kernels; only the cache differs.
The harness flushes the cache and gives each arm its own session (``X-Leyline-Session``),
so an arm's spliced rows are seen by that arm only; exact rows (plain prefills) are shared.

    FULL      the unedited history, prefilled (no edit: what the model saw)
    FORGET    the edited history, prefilled (the edit done by re-prefilling)
    AMORTIZE  the unedited history prefilled, then the edit spliced into the cache by a
              directive (mode amortize): the tail keeps its cached rows
    REPAIR    the same with mode repair at the server's default budget: a fraction of the
              tail's rows recomputed after the splice

To add an arm: write its ``history`` function and add it to ``ARMS`` (``splice_arm`` builds
one for any directive mode, with extra directive fields such as ``budget``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

__all__ = ["ARMS", "Arm", "Case", "Completion", "QualityServer", "splice_arm"]

TOP_K = 20  # the most logprobs the API gives per position


@dataclass(frozen=True, slots=True)
class Case:
    """One conversation at token level: the history ``tokens`` (T), the edit of its stale
    output ``T[start:end] -> replacement``, the new question turn ``question`` (with the
    generation prompt) and, for a fact case, the answer's tokens ``target``."""

    id: str
    kind: str  # general | quoted_next | quoted_later | span_only
    variant: str  # stub | delete
    tokens: list[int]
    start: int
    end: int
    replacement: list[int]
    question: list[int]
    target: list[int] = field(default_factory=list)

    @property
    def edited(self) -> list[int]:
        """T' = T[:start] + replacement + T[end:]."""
        return self.tokens[: self.start] + self.replacement + self.tokens[self.end :]


@dataclass(frozen=True, slots=True)
class Completion:
    """A greedy completion: its token texts and, per position, the top logprobs by text."""

    tokens: list[str]
    logprobs: list[float]
    top: list[dict[str, float]]
    cached: int = 0  # prompt tokens the server read from its cache (usage)


class QualityServer:
    """The few HTTP calls the arms and the harness make on a ``leyline serve``, in one
    session (``None``: the anonymous one)."""

    def __init__(self, base_url: str, model: str, timeout: float = 600.0,
                 session: str | None = None, http: httpx.Client | None = None) -> None:  # fmt: skip
        self.model = model
        self.base_url, self.session_name = base_url, session
        self.http = http or httpx.Client(base_url=base_url, timeout=timeout)
        self.headers = {"X-Leyline-Session": session} if session else {}

    def session(self, name: str) -> QualityServer:
        """The same server and connection, requests in session ``name``."""
        return QualityServer(self.base_url, self.model, session=name, http=self.http)

    def complete(self, prompt: list[int], max_tokens: int) -> Completion:
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0, "logprobs": TOP_K}  # fmt: skip
        r = self.http.post("/v1/completions", json=body, headers=self.headers)
        r.raise_for_status()
        j = r.json()
        lp = j["choices"][0]["logprobs"]
        details = (j.get("usage") or {}).get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens") or 0
        return Completion(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], cached)

    def flush(self) -> None:
        self.http.post("/leyline/v1/flush", json={}).raise_for_status()

    def directive(self, tokens: list[int], directive: dict[str, Any]) -> dict[str, Any]:
        r = self.http.post("/leyline/v1/directives", json={"tokens": tokens, "directives": [directive]},
                           headers=self.headers)  # fmt: skip
        if r.status_code != 200:
            raise RuntimeError(f"directive refused: {r.status_code} {r.text}")
        return r.json()

    def close(self) -> None:
        self.http.close()


@dataclass(frozen=True, slots=True)
class Arm:
    """``edited``: the arm serves the edited history (False: the edit's variant does not
    matter, so the harness serves each conversation once and reuses the result).
    ``splice``: the arm's history is a splice (its answer must be read from the cache, past
    ``T'``); otherwise it is a prefill, which may reuse only rows of exact prefills."""

    name: str
    history: Callable[[QualityServer, Case], list[int]]
    edited: bool = True
    splice: bool = False


def _full(server: QualityServer, case: Case) -> list[int]:
    return case.tokens


def _forget(server: QualityServer, case: Case) -> list[int]:
    return case.edited


def splice_arm(name: str, mode: str, **fields: Any) -> Arm:
    """An arm that prefills T, then splices the edit with a directive of ``mode``."""

    def history(server: QualityServer, case: Case) -> list[int]:
        server.complete(case.tokens, 1)  # T in the cache, as after the turn that produced it
        d = {"start": case.start, "end": case.end, "replacement": case.replacement,
             "mode": mode, **fields}  # fmt: skip
        out = server.directive(case.tokens, d)
        if out.get("tokens") != case.edited:
            raise RuntimeError(f"{name}: the directive's T' differs from the edited history")
        return case.edited

    return Arm(name, history, splice=True)


ARMS: dict[str, Arm] = {
    "full": Arm("FULL", _full, edited=False),
    "forget": Arm("FORGET", _forget),
    "amortize": splice_arm("AMORTIZE", "amortize"),
    "repair": splice_arm("REPAIR", "repair"),
}
