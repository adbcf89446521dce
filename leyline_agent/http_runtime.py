"""``HTTPRuntime`` / ``AsyncHTTPRuntime``: the ``Runtime`` protocols over HTTP.

    POST {base}/leyline/v1/directives   DirectivesRequest -> DirectivesResponse
    GET  {base}/leyline/v1/stats        -> StatsResponse

``base`` is the server root; a trailing ``/v1`` (an OpenAI client's base URL) is stripped.
Connection errors are retried (tenacity, ``retries`` attempts, exponential backoff; a GET
also on read timeouts, a POST not: it may have been applied) and then raise
``RuntimeUnavailableError``. Answers: 2xx -> the response model;
404/405 -> ``RuntimeUnavailableError`` (a plain OpenAI-compatible endpoint has no Leyline
routes; ``has_leyline()`` asks without raising); other 4xx -> the server's ``ErrorBody``
as ``DirectiveError`` / ``CacheMissError`` / ``UnsupportedModeError``; 5xx ->
``RuntimeUnavailableError``. Sync and async share everything but the transport call.
"""

from __future__ import annotations

from typing import Any, TypeVar

import httpx
import structlog
from pydantic import BaseModel, ValidationError
from tenacity import (
    AsyncRetrying,
    RetryError,
    Retrying,
    retry_if_exception_type,
    stop_after_attempt,
    wait_exponential,
)

from leyline_agent.errors import (
    CacheMissError,
    DirectiveError,
    LeylineError,
    RuntimeUnavailableError,
    UnsupportedModeError,
)
from leyline_agent.wire import DirectivesRequest, DirectivesResponse, ErrorBody, StatsResponse

__all__ = ["AsyncHTTPRuntime", "HTTPRuntime", "NoLeylineRoutesError", "server_root"]

log = structlog.get_logger(__name__)

DIRECTIVES_PATH = "/leyline/v1/directives"
STATS_PATH = "/leyline/v1/stats"
_ERRORS: dict[str, type[LeylineError]] = {
    "CacheMissError": CacheMissError,
    "UnsupportedModeError": UnsupportedModeError,
    "DirectiveError": DirectiveError,
}
M = TypeVar("M", bound=BaseModel)
_CONNECT_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout)


class NoLeylineRoutesError(RuntimeUnavailableError):
    """The server answers, but has no ``/leyline/v1/...`` routes (plain OpenAI endpoint)."""


def server_root(base_url: Any) -> str:
    """``http://host:port/v1/`` -> ``http://host:port`` (the Leyline routes live at the root)."""
    url = str(base_url).rstrip("/")
    if url.endswith("/v1"):
        url = url[: -len("/v1")]
    if not url.startswith(("http://", "https://")):
        raise RuntimeUnavailableError(f"base_url: {base_url!r} is not an http(s) URL")
    return url


class _HTTPRuntimeBase:
    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        timeout: float = 30.0,
        retries: int = 3,
        backoff_s: float = 0.2,
    ) -> None:
        if retries < 1:
            raise RuntimeUnavailableError(f"retries: must be >= 1, got {retries}")
        self.base_url = server_root(base_url)
        self.timeout = timeout
        self.retries = retries
        self.backoff_s = backoff_s
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def _retry_kwargs(self, method: str) -> dict[str, Any]:
        # A POST is retried only if it never reached the server (a directive applied twice
        # would find its base gone); a GET is retried on any transport error.
        retry_on = _CONNECT_ERRORS if method == "POST" else (httpx.TransportError,)
        return {
            "stop": stop_after_attempt(self.retries),
            "wait": wait_exponential(multiplier=self.backoff_s, max=2.0),
            "retry": retry_if_exception_type(retry_on),
            "reraise": False,
        }

    def _unreachable(self, path: str, e: BaseException) -> RuntimeUnavailableError:
        retried = isinstance(e, RetryError)
        cause = e.last_attempt.exception() if retried else e
        tries = f" after {self.retries} attempts" if retried else ""
        return RuntimeUnavailableError(
            f"cannot reach {self.base_url}{path}{tries}: {type(cause).__name__}: {cause}"
        )

    def _parse(self, path: str, resp: httpx.Response, model: type[M]) -> M:
        url = f"{self.base_url}{path}"
        if resp.status_code == 404 and _error_type(resp) == "ModelNotFoundError":
            raise _error_from_body(url, resp)  # the routes exist; the model name is wrong
        if resp.status_code in (404, 405):
            raise NoLeylineRoutesError(
                f"{url}: HTTP {resp.status_code}; the server has no Leyline routes "
                "(a plain OpenAI-compatible endpoint?)"
            )
        if resp.status_code >= 500:
            raise RuntimeUnavailableError(f"{url}: HTTP {resp.status_code}: {resp.text[:300]}")
        if resp.status_code >= 400:
            raise _error_from_body(url, resp)
        try:
            return model.model_validate(resp.json())
        except (ValueError, ValidationError) as e:
            raise RuntimeUnavailableError(
                f"{url}: answer is not a valid {model.__name__}: {e}"
            ) from e

    @staticmethod
    def _body(request: DirectivesRequest) -> dict[str, Any]:
        return request.model_dump(mode="json", exclude_none=True)


def _error_type(resp: httpx.Response) -> str | None:
    try:
        return str(resp.json()["error"]["type"])
    except (ValueError, KeyError, TypeError):
        return None


def _error_from_body(url: str, resp: httpx.Response) -> LeylineError:
    try:
        body = ErrorBody.model_validate(resp.json()["error"])
    except (ValueError, KeyError, TypeError, ValidationError):
        return DirectiveError(f"{url}: HTTP {resp.status_code}: {resp.text[:300]}")
    cls = _ERRORS.get(body.type, DirectiveError)
    field = f" (field {body.field})" if body.field else ""
    return cls(f"{url}: {body.type}: {body.message}{field}")


class HTTPRuntime(_HTTPRuntimeBase):
    """Synchronous ``Runtime`` talking to a Leyline server (or the SGLang plugin)."""

    def __init__(self, base_url: str, *, client: httpx.Client | None = None, **kw: Any) -> None:
        super().__init__(base_url, **kw)
        self._client = client or httpx.Client(timeout=self.timeout)

    def _call(self, method: str, path: str, model: type[M], json: Any = None) -> M:
        try:
            for attempt in Retrying(**self._retry_kwargs(method)):
                with attempt:
                    resp = self._client.request(
                        method, self.base_url + path, json=json, headers=self.headers
                    )
        except (RetryError, httpx.HTTPError) as e:
            raise self._unreachable(path, e) from e
        return self._parse(path, resp, model)

    def apply_directives(self, request: DirectivesRequest) -> DirectivesResponse:
        return self._call("POST", DIRECTIVES_PATH, DirectivesResponse, self._body(request))

    def stats(self) -> StatsResponse:
        return self._call("GET", STATS_PATH, StatsResponse)

    def has_leyline(self) -> bool:
        """True if the server answers ``/leyline/v1/stats``; False for a plain endpoint.
        Raises ``RuntimeUnavailableError`` if the server cannot be reached at all."""
        try:
            self.stats()
        except NoLeylineRoutesError:
            return False
        return True

    def close(self) -> None:
        self._client.close()


class AsyncHTTPRuntime(_HTTPRuntimeBase):
    """The ``AsyncRuntime`` twin of ``HTTPRuntime`` (httpx.AsyncClient)."""

    def __init__(
        self, base_url: str, *, client: httpx.AsyncClient | None = None, **kw: Any
    ) -> None:
        super().__init__(base_url, **kw)
        self._client = client or httpx.AsyncClient(timeout=self.timeout)

    async def _call(self, method: str, path: str, model: type[M], json: Any = None) -> M:
        try:
            async for attempt in AsyncRetrying(**self._retry_kwargs(method)):
                with attempt:
                    resp = await self._client.request(
                        method, self.base_url + path, json=json, headers=self.headers
                    )
        except (RetryError, httpx.HTTPError) as e:
            raise self._unreachable(path, e) from e
        return self._parse(path, resp, model)

    async def apply_directives(self, request: DirectivesRequest) -> DirectivesResponse:
        return await self._call("POST", DIRECTIVES_PATH, DirectivesResponse, self._body(request))

    async def stats(self) -> StatsResponse:
        return await self._call("GET", STATS_PATH, StatsResponse)

    async def has_leyline(self) -> bool:
        try:
            await self.stats()
        except NoLeylineRoutesError:
            return False
        return True

    async def aclose(self) -> None:
        await self._client.aclose()
