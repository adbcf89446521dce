"""``wrap_openai``: put context policies into an existing OpenAI-client agent loop.

    client = wrap_openai(openai.OpenAI(base_url=...), policies=["stale-tool"])
    client.chat.completions.create(model=..., messages=history, tools=tools)  # as before

The result is a copy of the client (same class, same HTTP connection pool; the original is
left untouched; its own copies, ``with_options(...)``, are wrapped alike and share its
sessions) whose ``chat.completions.create`` (and ``responses.create``, read as the chat
messages its items stand for: ``responses_items``) runs the policies (a ``ContextSession``)
on the incoming messages, sends the edited list with this turn's edits of already-cached
messages in the request body itself (``{"leyline": {"client_edits": mode, "edits":
[...]}}``: the server splices them in the turn's own job, before its prefill; no separate
directive request), and observes the reply (for streams: once the stream has been
consumed). Edits the agent makes to its own history in place (a framework that stubs old
tool results) keep the session and ride along the same way. Everything else on the client
passes through unchanged.

Session identity: ``session_id=`` (or the client's own ``X-Leyline-Session`` default header)
names the one session of every call. Without one, sessions are found by content, as
``LeylineTransport`` does: a call continues the session whose last turn its messages repeat
(the longest such, preferring one whose observed reply they echo; not one with a
non-streamed call in flight), else it starts a new session (the first one's id is
``state.default_session``). So concurrent conversations on one wrapped client each get their
own session and their own directives. A call can pick a session with
``extra_body={"leyline_session": "id"}`` (that key is removed before the request is
forwarded) or with its own ``extra_headers={"X-Leyline-Session": "id"}``.
The server reuses a session's spliced KV rows only for requests that name the session, so
every call the wrapper makes for a session names it: the chat completion carries the
``X-Leyline-Session`` header (merged into the call's ``extra_headers``; a header the user
set is kept as it is, and is then the call's session), and each directive request carries
it in its ``session`` field and (``HTTPRuntime``) the same header. Session ids are 1 to 256
printable ASCII characters (they travel in a header). ``leyline_state(wrapped)`` gives the
state, typed ``LeylineState`` (``.session(id)``, ``.sessions``, ``.runtime``); it is also
``wrapped.leyline`` (typed through the ``LeylineWrapped`` protocol: ``wrap_openai`` returns
the client's own type, which does not declare it). The sessions live in a
``registry.SessionRegistry`` (the transport's too), which keeps a bounded number of them.

Runtime: ``None`` / ``"auto"``: the client's base URL (``/v1`` stripped) is checked once for
``/leyline/v1/stats`` (an ``HTTPRuntime`` with the client's ``api_key`` as its bearer key);
a Leyline server gets the edits in the chat request's ``leyline`` body field, a plain
OpenAI-compatible endpoint gets neither that field nor directives (edits cost a
re-prefill). A ``Runtime`` / ``AsyncRuntime`` object: explicit use, the edits go to it as
directives (``apply_directives``) before the call, and the call carries ``{"leyline":
{"client_edits": "off"}}`` (the server must not splice them again). ``"off"``: neither.
A call's own ``extra_body={"leyline": {...}}`` keys win over the wrapper's (its
``"client_edits": "off"`` drops the edits).

Messages may be dicts or SDK message objects (``response.choices[0].message`` appended as
is): objects are dumped to dicts before the policies see them. One session expects one
conversation at a time: concurrent calls of the same session are not ordered.

Failures of the middleware itself (a runtime error, a trajectory the validator refuses)
are logged and counted, and the user's call goes through (unedited if the policies could
not run); ``strict=True`` raises them instead. ``BaseException`` is never swallowed.
"""

from __future__ import annotations

import functools
import threading
import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar, overload, runtime_checkable

from leyline_agent.agent.http_runtime import AsyncHTTPRuntime, AuthenticationError, HTTPRuntime
from leyline_agent.agent.registry import SessionRegistry
from leyline_agent.agent.session import ContextSession, Plan
from leyline_agent.agent.stream_observer import AsyncObservedStream, ObservedStream
from leyline_agent.directives import Mode
from leyline_agent.errors import LeylineError, RuntimeUnavailableError
from leyline_agent.logs import get_logger
from leyline_agent.namespaces import SESSION_HEADER, check_session_id
from leyline_agent.protocols import AsyncRuntime, Runtime
from leyline_agent.responses_items import edited_items, reply_message, responses_messages

if TYPE_CHECKING:
    from openai import AsyncOpenAI, OpenAI

__all__ = [
    "LeylineState",
    "LeylineWrapped",
    "SESSION_KEY",
    "client_session_id",
    "leyline_state",
    "with_leyline_field",
    "wrap_openai",
]

log = get_logger(__name__)  # silent until configured (leyline_agent.logs)

SESSION_KEY = "leyline_session"
RuntimeSpec = Runtime | AsyncRuntime | Literal["auto", "off"] | None
C = TypeVar("C")


class LeylineState:
    """What a wrapped client remembers: its sessions and its runtime."""

    def __init__(
        self,
        client: Any,
        policies: Sequence[Any],
        runtime: RuntimeSpec,
        session_id: str | None,
        mode: Mode,
        is_async: bool,
        strict: bool,
    ) -> None:
        from leyline_agent.policies import load_policy

        self.policies = [load_policy(p, where=f"policies[{k}]") for k, p in enumerate(policies)]
        self.mode = Mode(mode)
        self.default_session = _default_session(client, session_id)
        self.by_content = session_id is None and not _client_session(client)
        self._registry = SessionRegistry(self._new_session)
        self.strict = strict
        self.failures = 0  # policy-layer failures let through
        self._lock = threading.Lock()
        self._detected = False
        self.rides = runtime is None or runtime == "auto"  # edits ride in the chat body
        if runtime is None or runtime == "auto":
            cls = AsyncHTTPRuntime if is_async else HTTPRuntime
            self.runtime: Any = cls(str(client.base_url), api_key=getattr(client, "api_key", None))
        elif runtime == "off":
            self.runtime, self._detected = None, True
        elif isinstance(runtime, (Runtime, AsyncRuntime)):
            self.runtime, self._detected = runtime, True
        else:
            raise LeylineError(
                f"runtime: expected a Runtime, 'auto', 'off' or None, got {runtime!r}"
            )

    @property
    def sessions(self) -> dict[str, ContextSession]:
        """Every session kept, by id (a snapshot)."""
        return {s.session_id: s for s in self._registry.sessions()}

    def session(self, session_id: str | None = None) -> ContextSession:
        return self._registry.named(session_id or self.default_session)

    def by_messages(self, messages: list[Any]) -> ContextSession:
        """The session ``messages`` continue (see the module doc), marked busy, or a new one
        (the first one is ``default_session``)."""
        return self._registry.by_content(messages, first_id=self.default_session)

    def release(self, session: ContextSession) -> None:
        self._registry.release(session)

    def _new_session(self, sid: str) -> ContextSession:
        return ContextSession(
            self.policies, None, mode=self.mode, session_id=sid, fallback=not self.strict
        )

    def split(self, kwargs: dict[str, Any]) -> tuple[ContextSession, dict[str, Any]]:
        """The session a call belongs to, and the kwargs to forward: the Leyline key removed
        from ``extra_body``, the session header merged into ``extra_headers``."""
        kwargs = dict(kwargs)
        extra = kwargs.get("extra_body")
        sid = None
        if isinstance(extra, dict) and SESSION_KEY in extra:
            extra = dict(extra)
            sid = client_session_id(extra.pop(SESSION_KEY), f"extra_body.{SESSION_KEY}")
            if extra:
                kwargs["extra_body"] = extra
            else:
                del kwargs["extra_body"]
        headers = dict(kwargs.get("extra_headers") or {})
        name = _header_name(headers, SESSION_HEADER)
        if name is None:
            if sid is None and self.by_content and isinstance(kwargs.get("messages"), list):
                session = self.by_messages(_call_args(kwargs)[0])
                headers[SESSION_HEADER] = session.session_id
                kwargs["extra_headers"] = headers
                return session, kwargs
            headers[SESSION_HEADER] = sid or self.default_session
        elif isinstance(headers[name], str):  # the user's own header names the session
            own = client_session_id(headers[name], f"extra_headers[{name!r}]")
            if sid is not None and own != sid:
                raise LeylineError(
                    f"extra_headers[{name!r}]: {own!r} contradicts extra_body.{SESSION_KEY} {sid!r}"
                )
            sid = own
        kwargs["extra_headers"] = headers
        return self.session(sid), kwargs

    # -- runtime detection (once) ---------------------------------------------------------
    def _detected_runtime(self, has: bool | None) -> Any:
        if has is None:
            return None  # unreachable: try again next call
        self._detected = True
        if not has:
            log.info("wrap_openai.plain_endpoint", base_url=self.runtime.base_url)
            self.runtime = None
        return self.runtime

    def resolve_runtime(self) -> Any:
        if self._detected:
            return self.runtime
        try:
            has: bool | None = self.runtime.has_leyline()
        except (RuntimeUnavailableError, AuthenticationError) as e:
            log.warning("wrap_openai.runtime_unreachable", error=str(e))
            has = None
        return self._detected_runtime(has)

    async def aresolve_runtime(self) -> Any:
        if self._detected:
            return self.runtime
        try:
            has: bool | None = await self.runtime.has_leyline()
        except (RuntimeUnavailableError, AuthenticationError) as e:
            log.warning("wrap_openai.runtime_unreachable", error=str(e))
            has = None
        return self._detected_runtime(has)

    # -- around the call --------------------------------------------------------------------
    def policy_failed(self, session: ContextSession, e: Exception) -> None:
        if self.strict:
            raise e
        self.failures += 1
        session.reset()
        log.warning("wrap_openai.policies_failed", session=session.session_id, error=str(e))

    def observe(self, session: ContextSession, response: Any, stream: bool, is_async: bool) -> Any:
        if stream:
            cls = AsyncObservedStream if is_async else ObservedStream
            return cls(response, session.observe_reply)
        choices = getattr(response, "choices", None)
        if choices:
            session.observe_reply(choices[0].message)
        return response


def client_session_id(value: object, where: str) -> str | None:
    """A session id given by the user, checked as the server checks it, and ASCII (it
    travels in a header); ``LeylineError`` naming ``where`` otherwise."""
    try:
        sid = check_session_id(value, where)
    except ValueError as e:
        raise LeylineError(str(e)) from None
    if sid is not None and not sid.isascii():
        raise LeylineError(f"{where}: must be ASCII (it travels in the {SESSION_HEADER} header)")
    return sid


def _header_name(headers: Any, name: str) -> str | None:
    """The key under which ``headers`` holds ``name`` (header names ignore case), or None."""
    return next((k for k in headers if isinstance(k, str) and k.lower() == name.lower()), None)


def _client_session(client: Any) -> tuple[str, str] | None:
    """(header name, value) of the client's own ``X-Leyline-Session`` default header."""
    defaults = getattr(client, "default_headers", None) or {}
    name = _header_name(defaults, SESSION_HEADER)
    return (name, defaults[name]) if name is not None and isinstance(defaults[name], str) else None


def _default_session(client: Any, session_id: str | None) -> str:
    """``session_id``, or the client's own ``X-Leyline-Session`` default header, or a new id."""
    sid = client_session_id(session_id, "session_id")
    name, own = _client_session(client) or (None, None)
    if own is not None:
        own = client_session_id(own, f"default_headers[{name!r}]")
        if sid is not None and own != sid:
            raise LeylineError(
                f"session_id: {sid!r} contradicts the client's {name} header {own!r}"
            )
        return own
    return sid or f"leyline-{uuid.uuid4().hex[:12]}"


def _call_args(kwargs: dict[str, Any]) -> tuple[list[Any], list[Any] | None, str | None]:
    """messages (SDK message objects dumped to dicts), tools and model of a create call."""
    messages = [
        m.model_dump(exclude_none=True) if hasattr(m, "model_dump") else m
        for m in kwargs["messages"]
    ]
    tools = kwargs.get("tools")
    model = kwargs.get("model")
    return (
        messages,
        list(tools) if isinstance(tools, (list, tuple)) else None,
        model if isinstance(model, str) else None,
    )


def rides_in_body(runtime: Any) -> bool:
    """Does the runtime's server apply a chat body's ``leyline.edits`` (its stats say so)?
    Otherwise the session sends its edits as directive requests: a server that ignored the
    field would drop them silently."""
    return runtime is not None and bool(getattr(runtime, "body_edits", False))


def with_leyline_field(body: dict[str, Any], key: str, ours: dict[str, Any]) -> None:
    """Put the wrapper's ``leyline`` options into ``body[key]`` (the ``extra_body`` of a
    call, or a request body itself): the caller's own keys win, and its ``"client_edits":
    "off"`` drops the edits (they could not act)."""
    own = body.get(key)
    merged = {**ours, **own} if isinstance(own, dict) else ours if own is None else own
    if isinstance(merged, dict) and merged.get("client_edits") == "off":
        merged = {k: v for k, v in merged.items() if k != "edits"}
    if merged != {} or own is not None:
        body[key] = merged


def _prepare(state: LeylineState, session: ContextSession, kwargs: dict[str, Any]) -> Plan | None:
    """With edits riding in the body: the plan, its ``leyline`` field set on the call's
    ``extra_body``. None: the session goes through ``prepare`` (a ``Runtime`` given, or a
    plain endpoint)."""
    if not (state.rides and rides_in_body(session.runtime)):
        return None
    plan = session.plan(*_call_args(kwargs))
    extra = dict(kwargs.get("extra_body") or {})
    with_leyline_field(extra, "leyline", session.leyline_field(plan))
    kwargs["extra_body"] = extra
    return plan


def _edits_spliced_here(kwargs: dict[str, Any], runtime: Any, state: LeylineState) -> None:
    """A ``Runtime`` given sends the edits as directives itself: tell a Leyline server not to
    splice them a second time as client-made edits (``{"leyline": {"client_edits":
    "off"}}``), unless the call sets its own ``leyline`` options. Not sent to a plain
    endpoint (no runtime), nor when the edits ride in the body."""
    if runtime is None or (state.rides and rides_in_body(runtime)):
        return
    extra = dict(kwargs.get("extra_body") or {})
    extra.setdefault("leyline", {"client_edits": "off"})
    kwargs["extra_body"] = extra


def _make_create(
    original: Callable[..., Any], state: LeylineState, is_async: bool
) -> Callable[..., Any]:
    """The wrapped ``create``: one body for sync and async, the awaits switched by ``is_async``."""

    def before(kwargs: dict[str, Any]) -> tuple[ContextSession, dict[str, Any], bool]:
        session, kwargs = state.split(kwargs)
        return session, kwargs, kwargs.get("stream") is True

    if is_async:

        @functools.wraps(original)
        async def acreate(*args: Any, **kwargs: Any) -> Any:
            session, kwargs, stream = before(kwargs)
            if "messages" in kwargs:
                session.runtime = await state.aresolve_runtime()
                try:
                    plan = _prepare(state, session, kwargs)
                    kwargs["messages"] = (
                        plan.messages_to_send
                        if plan is not None
                        else await session.aprepare(*_call_args(kwargs))
                    )
                except Exception as e:  # noqa: BLE001
                    state.policy_failed(session, e)
                _edits_spliced_here(kwargs, session.runtime, state)
            try:
                response = await original(*args, **kwargs)
                return state.observe(session, response, stream, is_async=True)
            finally:
                state.release(session)

        return acreate

    @functools.wraps(original)
    def create(*args: Any, **kwargs: Any) -> Any:
        session, kwargs, stream = before(kwargs)
        if "messages" in kwargs:
            session.runtime = state.resolve_runtime()
            try:
                plan = _prepare(state, session, kwargs)
                kwargs["messages"] = (
                    plan.messages_to_send
                    if plan is not None
                    else session.prepare(*_call_args(kwargs))
                )
            except Exception as e:  # noqa: BLE001 - let the user's call through
                state.policy_failed(session, e)
            _edits_spliced_here(kwargs, session.runtime, state)
        try:
            response = original(*args, **kwargs)
            return state.observe(session, response, stream, is_async=False)
        finally:
            state.release(session)

    return create


class _ResponsesCall:
    """A ``responses.create`` call read as chat: the messages it stands for, its session,
    and the kwargs to forward (``None`` session: passed through as the SDK built it)."""

    def __init__(self, state: LeylineState, kwargs: dict[str, Any]) -> None:
        self.state, self.stream = state, kwargs.get("stream") is True
        given = {k: v for k, v in kwargs.items() if not _omitted(v)}
        raw = given.get("input", [])
        self.items = [_dumped(i) for i in raw] if isinstance(raw, list) else []
        body = {k: given.get(k) for k in ("instructions", "tools", "previous_response_id")}
        body["tools"] = [_dumped(t) for t in body["tools"] or ()]
        body["input"] = self.items if isinstance(raw, list) else raw
        self.session: ContextSession | None = None
        try:
            self.messages, self.tools, self.head = responses_messages(body)
        except Exception as e:  # noqa: BLE001 - counted, logged, let through
            if state.strict:
                raise
            state.failures += 1
            log.warning("wrap_openai.responses_unhandled", error=f"{type(e).__name__}: {e}")
            self.kwargs = kwargs
            return
        self.session, kw = state.split({**kwargs, "messages": self.messages})
        kw.pop("messages")
        self.kwargs = kw

    def apply(self, sent: list[dict[str, Any]] | None, call: dict[str, Any]) -> None:
        """The policies' list ``sent`` written back into the items; ``call``'s body fields."""
        if "extra_body" in call:
            self.kwargs["extra_body"] = call["extra_body"]
        if sent is None or sent == self.messages:
            return
        if sent[: self.head] != self.messages[: self.head]:
            raise ValueError("a policy edited the instructions")
        h = self.head
        self.kwargs["input"] = edited_items(self.items, self.messages[h:], sent[h:])

    def plan_call(self) -> dict[str, Any]:
        return {**self.kwargs, "messages": self.messages, "tools": self.tools}

    def observe(self, response: Any, is_async: bool) -> Any:
        assert self.session is not None
        if self.stream:
            cls = AsyncObservedStream if is_async else ObservedStream
            return cls(response, self.session.observe_reply)
        output = getattr(response, "output", None)
        if output is not None:
            self.session.observe_reply(reply_message([_dumped(o) for o in output]))
        return response


def _dumped(obj: Any) -> Any:
    return obj.model_dump(exclude_none=True) if hasattr(obj, "model_dump") else obj


def _omitted(value: Any) -> bool:
    """The SDK's "not given" markers (``NOT_GIVEN``, ``omit``) in a call's keyword arguments."""
    return type(value).__name__ in ("NotGiven", "Omit")


def _make_responses_create(
    original: Callable[..., Any], state: LeylineState, is_async: bool
) -> Callable[..., Any]:
    """The wrapped ``responses.create``: the policies run on the messages the request
    stands for (``responses_items``), their edits written back into its items and riding
    in the body as on chat. A request it cannot read so is counted and logged, then sent
    as it is."""

    if is_async:

        @functools.wraps(original)
        async def acreate(*args: Any, **kwargs: Any) -> Any:
            rc = _ResponsesCall(state, kwargs)
            if rc.session is None:
                return await original(*args, **kwargs)
            session = rc.session
            session.runtime = await state.aresolve_runtime()
            try:
                call = rc.plan_call()
                plan = _prepare(state, session, call)
                sent = (
                    plan.messages_to_send
                    if plan is not None
                    else await session.aprepare(*_call_args(call))
                )
                rc.apply(sent, call)
            except Exception as e:  # noqa: BLE001
                state.policy_failed(session, e)
            _edits_spliced_here(rc.kwargs, session.runtime, state)
            try:
                return rc.observe(await original(*args, **rc.kwargs), is_async=True)
            finally:
                state.release(session)

        return acreate

    @functools.wraps(original)
    def create(*args: Any, **kwargs: Any) -> Any:
        rc = _ResponsesCall(state, kwargs)
        if rc.session is None:
            return original(*args, **kwargs)
        session = rc.session
        session.runtime = state.resolve_runtime()
        try:
            call = rc.plan_call()
            plan = _prepare(state, session, call)
            sent = plan.messages_to_send if plan is not None else session.prepare(*_call_args(call))
            rc.apply(sent, call)
        except Exception as e:  # noqa: BLE001 - let the user's call through
            state.policy_failed(session, e)
        _edits_spliced_here(rc.kwargs, session.runtime, state)
        try:
            return rc.observe(original(*args, **rc.kwargs), is_async=False)
        finally:
            state.release(session)

    return create


@overload
def wrap_openai(
    client: OpenAI,
    policies: Sequence[Any] = ...,
    runtime: RuntimeSpec = ...,
    session_id: str | None = ...,
    mode: Mode = ...,
    *,
    strict: bool = ...,
) -> OpenAI: ...
@overload
def wrap_openai(
    client: AsyncOpenAI,
    policies: Sequence[Any] = ...,
    runtime: RuntimeSpec = ...,
    session_id: str | None = ...,
    mode: Mode = ...,
    *,
    strict: bool = ...,
) -> AsyncOpenAI: ...
def wrap_openai(
    client: Any,
    policies: Sequence[Any] = ("stale-tool",),
    runtime: RuntimeSpec = None,
    session_id: str | None = None,
    mode: Mode = Mode.AMORTIZE,
    *,
    strict: bool = False,
) -> Any:
    """A copy of ``client`` whose ``chat.completions.create`` and ``responses.create`` apply
    ``policies``.

    ``policies``: ``Policy`` objects, names (``"stale-tool"``) or ``{"name": ..., **knobs}``.
    """
    if not hasattr(client, "with_options") or not hasattr(client, "chat"):
        raise LeylineError(
            f"client: expected an openai.OpenAI or AsyncOpenAI, got {type(client).__name__}"
        )
    wrapped = client.with_options()
    is_async = _is_async(wrapped.chat.completions.create, client)
    state = LeylineState(wrapped, policies, runtime, session_id, mode, is_async, strict)
    _install(wrapped, state, is_async)
    return wrapped


@runtime_checkable
class LeylineWrapped(Protocol):
    """A client ``wrap_openai`` made (``isinstance(client, LeylineWrapped)`` tells)."""

    @property
    def leyline(self) -> LeylineState: ...


def leyline_state(client: object) -> LeylineState:
    """The ``LeylineState`` of a client ``wrap_openai`` made (or of a copy of one)."""
    state = getattr(client, "leyline", None)
    if not isinstance(state, LeylineState):
        raise LeylineError(
            f"client: {type(client).__name__} was not made by wrap_openai (no Leyline state)"
        )
    return state


def _install(wrapped: Any, state: LeylineState, is_async: bool) -> None:
    """Wrap ``create`` of ``wrapped`` (chat, and Responses where the SDK has it); its copies
    (``with_options(timeout=...)``, ``copy``) are wrapped too and share ``state``."""
    completions = wrapped.chat.completions
    completions.create = _make_create(completions.create, state, is_async)
    responses = getattr(wrapped, "responses", None)
    if responses is not None:
        responses.create = _make_responses_create(responses.create, state, is_async)
    copy = wrapped.copy

    @functools.wraps(copy)
    def copy_wrapped(*args: Any, **kwargs: Any) -> Any:
        new = copy(*args, **kwargs)
        _install(new, state, is_async)
        return new

    wrapped.copy = wrapped.with_options = copy_wrapped
    wrapped.leyline = state


def _is_async(fn: Callable[..., Any], client: Any) -> bool:
    """The SDK decorates ``create`` with a plain wrapper: look through it, or at the client."""
    import inspect

    return inspect.iscoroutinefunction(inspect.unwrap(fn)) or type(client).__name__.startswith(
        "Async"
    )
