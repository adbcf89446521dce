"""``HTTPRuntime`` / ``AsyncHTTPRuntime``: the ``Runtime`` protocols over HTTP.

    POST {base}/leyline/v1/directives   DirectivesRequest -> DirectivesResponse
    GET  {base}/leyline/v1/stats        -> StatsResponse

``base`` is the server root; a trailing ``/v1`` (an OpenAI client's base URL) is stripped
(``server_root``: the one place in the package that does it; ``openai_base_url`` adds it).

Headers: ``Authorization: Bearer <api_key>`` on every request when a key is given (a
server without ``--api-key`` ignores it); a directive request that names a ``session``
also carries it as ``X-Leyline-Session``.

Retries (tenacity, ``retries`` attempts in all). Every directive POST carries an
idempotency key, ``request_id`` (a fresh uuid4 hex unless the request has one), and every
retry of it the same key, so a server that already executed it answers the first answer
and executes nothing. That makes a POST safe to retry also after it reached the server:
- a transport failure: connect errors and pool timeouts (never sent), a connection reset
  or closed before the answer, a failed write; a read timeout is *not* retried (the server
  is slow, not gone: asking again only queues a second copy behind the first);
- 502/503/504 with a ``Retry-After`` of at most ``max_retry_after_s``: retried after that
  many seconds (a server that is shedding load says when to come back); without one, or
  with a longer one, the answer stands.
Other waits back off exponentially. A GET is also retried on read timeouts. When the
attempts run out: ``RuntimeUnavailableError``.

Answers: 2xx -> the response model; 401/403 -> ``AuthenticationError`` (never retried);
404/405 -> ``NoLeylineRoutesError`` (a plain OpenAI-compatible endpoint has no Leyline
routes; ``has_leyline()`` asks without raising), except a 404 naming an unknown model;
other 4xx -> the server's ``ErrorBody`` as ``DirectiveError`` / ``CacheMissError`` /
``UnsupportedModeError``; 5xx -> ``RuntimeUnavailableError``. Sync and async share
everything but the transport call.
"""

from __future__ import annotations

import email.utils
import time
import uuid
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel, ValidationError
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    RetryError,
    Retrying,
    retry_if_exception,
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
from leyline_agent.logs import get_logger
from leyline_agent.namespaces import SESSION_HEADER
from leyline_agent.wire import (
    BODY_EDITS,
    CLIENT_EDITS,
    DirectivesRequest,
    DirectivesResponse,
    ErrorBody,
    StatsResponse,
)

__all__ = [
    "AsyncHTTPRuntime",
    "AuthenticationError",
    "HTTPRuntime",
    "NoLeylineRoutesError",
    "retry_after_s",
    "openai_base_url",
    "server_root",
]

log = get_logger(__name__)  # silent until configured (leyline_agent.logs)

DIRECTIVES_PATH = "/leyline/v1/directives"
STATS_PATH = "/leyline/v1/stats"
_ERRORS: dict[str, type[LeylineError]] = {
    "CacheMissError": CacheMissError,
    "UnsupportedModeError": UnsupportedModeError,
    "DirectiveError": DirectiveError,
}
M = TypeVar("M", bound=BaseModel)
# What a directive POST (idempotent by its request_id) is retried on: never sent, or the
# connection broke before the answer came. Not ReadTimeout: the server may still be at it.
_POST_RETRY_ERRORS: tuple[type[Exception], ...] = (
    httpx.ConnectError,
    httpx.ConnectTimeout,
    httpx.PoolTimeout,
    httpx.ReadError,
    httpx.WriteError,
    httpx.RemoteProtocolError,
)
_GET_RETRY_ERRORS: tuple[type[Exception], ...] = (httpx.TransportError,)
_RETRY_AFTER_STATUSES = frozenset({502, 503, 504})


class NoLeylineRoutesError(RuntimeUnavailableError):
    """The server answers, but has no ``/leyline/v1/...`` routes (plain OpenAI endpoint)."""


class AuthenticationError(LeylineError, PermissionError):
    """The server refused the request's API key (401) or its access (403)."""


class _RetryAfter(Exception):
    """A 502/503/504 whose ``Retry-After`` asks to come back in ``seconds``."""

    def __init__(self, response: httpx.Response, seconds: float) -> None:
        super().__init__(f"HTTP {response.status_code}, Retry-After {seconds:g} s")
        self.response = response
        self.seconds = seconds


def retry_after_s(resp: httpx.Response) -> float | None:
    """The ``Retry-After`` of a 502/503/504 in seconds (delta or HTTP date), else None."""
    if resp.status_code not in _RETRY_AFTER_STATUSES:
        return None
    value = resp.headers.get("Retry-After", "").strip()
    if not value:
        return None
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def server_root(base_url: Any) -> str:
    """``http://host:port/v1/`` -> ``http://host:port`` (the Leyline routes live at the root)."""
    url = str(base_url).rstrip("/")
    if url.endswith("/v1"):
        url = url[: -len("/v1")]
    if not url.startswith(("http://", "https://")):
        raise RuntimeUnavailableError(f"base_url: {base_url!r} is not an http(s) URL")
    return url


def openai_base_url(base_url: Any) -> str:
    """``http://host:port`` or ``http://host:port/v1`` -> ``http://host:port/v1`` (what an
    OpenAI client takes)."""
    return server_root(base_url) + "/v1"


class _HTTPRuntimeBase:
    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        timeout: float = 30.0,
        retries: int = 3,
        backoff_s: float = 0.2,
        max_retry_after_s: float = 10.0,
    ) -> None:
        if retries < 1:
            raise RuntimeUnavailableError(f"retries: must be >= 1, got {retries}")
        self.base_url = server_root(base_url)
        self.timeout = timeout
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_retry_after_s = max_retry_after_s
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # learnt from the stats answer: the server applies `leyline.edits` of a chat body
        # (`leyline serve`, the vLLM plugin); elsewhere (the SGLang plugin) edits go as
        # directives
        self.body_edits = False
        self.client_edits = False  # it also finds undeclared edits (CLIENT_EDITS)

    def _retry_kwargs(self, method: str) -> dict[str, Any]:
        errors = _POST_RETRY_ERRORS if method == "POST" else _GET_RETRY_ERRORS
        backoff = wait_exponential(multiplier=self.backoff_s, max=2.0)

        def retryable(e: BaseException) -> bool:
            if isinstance(e, _RetryAfter):
                return e.seconds <= self.max_retry_after_s
            return isinstance(e, errors)

        def wait(state: RetryCallState) -> float:
            e = state.outcome.exception() if state.outcome is not None else None
            return e.seconds if isinstance(e, _RetryAfter) else backoff(state)

        return {
            "stop": stop_after_attempt(self.retries),
            "wait": wait,
            "retry": retry_if_exception(retryable),
            "reraise": False,
        }

    def _answer(self, resp: httpx.Response) -> httpx.Response:
        """``resp``, or ``_RetryAfter`` (inside an attempt) if the server asks to come back."""
        seconds = retry_after_s(resp)
        if seconds is not None:
            raise _RetryAfter(resp, seconds)
        return resp

    def _ended(self, path: str, e: BaseException) -> httpx.Response:
        """After the attempts ended in ``e``: the answer to parse (a 5xx that asked for a
        retry the attempts or the wait limit did not allow), or ``RuntimeUnavailableError``."""
        last = e.last_attempt.exception() if isinstance(e, RetryError) else e
        if isinstance(last, _RetryAfter):
            return last.response
        raise self._unreachable(path, e) from e

    def _unreachable(self, path: str, e: BaseException) -> RuntimeUnavailableError:
        retried = isinstance(e, RetryError)
        cause = e.last_attempt.exception() if retried else e
        tries = f" after {self.retries} attempts" if retried else ""
        return RuntimeUnavailableError(
            f"cannot reach {self.base_url}{path}{tries}: {type(cause).__name__}: {cause}"
        )

    def _parse(self, path: str, resp: httpx.Response, model: type[M]) -> M:
        url = f"{self.base_url}{path}"
        if resp.status_code in (401, 403):
            given = "the API key was refused" if self.headers else "no API key was given"
            raise AuthenticationError(
                f"{url}: HTTP {resp.status_code}: {given}: {_error_message(resp)}"
            )
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

    def _directive(self, request: DirectivesRequest) -> tuple[dict[str, Any], dict[str, str]]:
        """Body and headers of a directive POST, the same for each of its attempts: a fresh
        ``request_id`` unless the request names one, the session in the header too."""
        body = request.model_dump(mode="json", exclude_none=True)
        body.setdefault("request_id", uuid.uuid4().hex)
        headers = {SESSION_HEADER: request.session} if request.session is not None else {}
        return body, headers


def _error_type(resp: httpx.Response) -> str | None:
    try:
        err = resp.json()["error"]
        return str(err.get("leyline_type") or err["type"])
    except (ValueError, KeyError, TypeError):
        return None


def _error_message(resp: httpx.Response) -> str:
    try:
        return str(resp.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return resp.text[:300]


def _error_from_body(url: str, resp: httpx.Response) -> LeylineError:
    try:
        body = ErrorBody.model_validate(resp.json()["error"])
    except (ValueError, KeyError, TypeError, ValidationError):
        return DirectiveError(f"{url}: HTTP {resp.status_code}: {resp.text[:300]}")
    kind = body.leyline_type or body.type  # a server that predates leyline_type named it here
    cls = _ERRORS.get(kind, DirectiveError)
    field = f" (field {body.field})" if body.field else ""
    return cls(f"{url}: {kind}: {body.message}{field}")


class HTTPRuntime(_HTTPRuntimeBase):
    """Synchronous ``Runtime`` talking to a Leyline server (or the SGLang plugin)."""

    def __init__(self, base_url: str, *, client: httpx.Client | None = None, **kw: Any) -> None:
        super().__init__(base_url, **kw)
        self._client = client or httpx.Client(timeout=self.timeout)

    def _call(
        self,
        method: str,
        path: str,
        model: type[M],
        json: Any = None,
        headers: dict[str, str] | None = None,
    ) -> M:
        headers = {**self.headers, **(headers or {})}
        try:
            for attempt in Retrying(**self._retry_kwargs(method)):
                with attempt:
                    resp = self._answer(
                        self._client.request(
                            method, self.base_url + path, json=json, headers=headers
                        )
                    )
        except (RetryError, _RetryAfter, httpx.HTTPError) as e:
            resp = self._ended(path, e)
        return self._parse(path, resp, model)

    def apply_directives(self, request: DirectivesRequest) -> DirectivesResponse:
        body, headers = self._directive(request)
        return self._call("POST", DIRECTIVES_PATH, DirectivesResponse, body, headers)

    def stats(self) -> StatsResponse:
        return self._call("GET", STATS_PATH, StatsResponse)

    def has_leyline(self) -> bool:
        """True if the server answers ``/leyline/v1/stats``; False for a plain endpoint.
        Raises ``RuntimeUnavailableError`` if the server cannot be reached at all."""
        try:
            features = self.stats().features
            self.body_edits, self.client_edits = BODY_EDITS in features, CLIENT_EDITS in features
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

    async def _call(
        self,
        method: str,
        path: str,
        model: type[M],
        json: Any = None,
        headers: dict[str, str] | None = None,
    ) -> M:
        headers = {**self.headers, **(headers or {})}
        try:
            async for attempt in AsyncRetrying(**self._retry_kwargs(method)):
                with attempt:
                    resp = self._answer(
                        await self._client.request(
                            method, self.base_url + path, json=json, headers=headers
                        )
                    )
        except (RetryError, _RetryAfter, httpx.HTTPError) as e:
            resp = self._ended(path, e)
        return self._parse(path, resp, model)

    async def apply_directives(self, request: DirectivesRequest) -> DirectivesResponse:
        body, headers = self._directive(request)
        return await self._call("POST", DIRECTIVES_PATH, DirectivesResponse, body, headers)

    async def stats(self) -> StatsResponse:
        return await self._call("GET", STATS_PATH, StatsResponse)

    async def has_leyline(self) -> bool:
        try:
            features = (await self.stats()).features
            self.body_edits, self.client_edits = BODY_EDITS in features, CLIENT_EDITS in features
        except NoLeylineRoutesError:
            return False
        return True

    async def aclose(self) -> None:
        await self._client.aclose()
