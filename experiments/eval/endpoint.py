"""An OpenAI-compatible endpoint as the experiments see it: liveness, model names, stats,
cache flush.

``/leyline/v1/stats`` is optional (a plain OpenAI endpoint has none): ``stats()`` then
returns ``None`` and the harness falls back to the ``usage`` blocks of the responses.
``/leyline/v1/flush`` is optional too: ``flush()`` returns the server's answer, or ``None``
where the endpoint has no such route (its cache then carries over between arms).
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx

from leyline_agent.agent.http_runtime import openai_base_url, server_root
from leyline_agent.errors import LeylineError, RuntimeUnavailableError
from leyline_agent.wire import StatsResponse

__all__ = ["Endpoint", "stats_delta"]


@dataclass(slots=True)
class Endpoint:
    base_url: str
    timeout_s: float = 10.0

    @property
    def root(self) -> str:
        return server_root(self.base_url)

    @property
    def openai_base_url(self) -> str:
        return openai_base_url(self.base_url)

    def models(self) -> list[str]:
        url = self.openai_base_url + "/models"
        try:
            r = httpx.get(url, timeout=self.timeout_s)
        except httpx.HTTPError as e:
            raise RuntimeUnavailableError(
                f"--base-url: endpoint {self.base_url} is not reachable ({type(e).__name__}: {e}); "
                "start one with `leyline serve --model DIR --port N`"
            ) from e
        if r.status_code != 200:
            raise RuntimeUnavailableError(
                f"--base-url: GET {url} answered {r.status_code}: {r.text[:200]}"
            )
        return [m.get("id", "") for m in r.json().get("data", [])]

    def check_model(self, model: str) -> None:
        names = self.models()
        if model not in names:
            raise LeylineError(
                f"--model: {model!r} is not served by {self.base_url}; served: {', '.join(names) or 'none'}"
            )

    def model_root(self, model: str) -> str | None:
        """The ``root`` the endpoint reports for ``model`` (vLLM and ``leyline serve``: the
        model's path), or None."""
        url = self.openai_base_url + "/models"
        try:
            r = httpx.get(url, timeout=self.timeout_s)
            data = r.json().get("data", []) if r.status_code == 200 else []
        except (httpx.HTTPError, ValueError):
            return None
        for m in data:
            if isinstance(m, dict) and m.get("id") == model and isinstance(m.get("root"), str):
                return m["root"]
        return None

    def flush(self) -> dict[str, object] | None:
        """Empty the endpoint's prefix cache (the caller's tenant); None if it cannot."""
        try:
            r = httpx.post(self.root + "/leyline/v1/flush", timeout=self.timeout_s)
        except httpx.HTTPError as e:
            raise RuntimeUnavailableError(f"endpoint {self.base_url} went away: {e}") from e
        if r.status_code in (404, 405):
            return None
        if r.status_code != 200:
            raise RuntimeUnavailableError(
                f"POST /leyline/v1/flush answered {r.status_code}: {r.text[:200]}"
            )
        return dict(r.json())

    def stats(self) -> StatsResponse | None:
        try:
            r = httpx.get(self.root + "/leyline/v1/stats", timeout=self.timeout_s)
        except httpx.HTTPError as e:
            raise RuntimeUnavailableError(f"endpoint {self.base_url} went away: {e}") from e
        if r.status_code == 404:
            return None
        if r.status_code != 200:
            raise RuntimeUnavailableError(f"GET /leyline/v1/stats answered {r.status_code}")
        return StatsResponse.model_validate(r.json())


def stats_delta(before: StatsResponse | None, after: StatsResponse | None) -> dict[str, object]:
    """Counter differences ``after - before`` (``{}`` without stats)."""
    if before is None or after is None:
        return {}
    splices = {
        k: after.splices.get(k, 0) - before.splices.get(k, 0)
        for k in sorted(set(after.splices) | set(before.splices))
    }
    return {
        "requests": after.requests - before.requests,
        "prompt_tokens": after.prompt_tokens - before.prompt_tokens,
        "cached_tokens": after.cached_tokens - before.cached_tokens,
        "prefilled_tokens": after.prefilled_tokens - before.prefilled_tokens,
        "splices": splices,
        "fallbacks": after.fallbacks - before.fallbacks,
        "directive_errors": after.directive_errors - before.directive_errors,
        "peak_cache_tokens": max(before.cache_tokens, after.cache_tokens),
    }
