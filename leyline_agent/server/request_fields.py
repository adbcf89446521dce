"""Every request field accounted for: honoured, refused by name, or listed as ignored.

Each OpenAI route's body is read field by field before it is served (``check_fields``, a
route dependency, so a handler that calls another route's handler, as ``/v1/responses``
calls chat's, is checked once, as the client sent it):

- a field of the route's own request model is honoured (the handler acts on it, or refuses
  a value it cannot act on with a 400 naming it);
- a field OpenAI documents as a hint (``HINTS``: who the user is, a service tier, metadata
  for OpenAI's dashboards, ...) is accepted and listed in the answer's ``leyline.ignored``
  (``{"field", "reason"}``), counted per tenant (``ignored_fields`` in
  ``/leyline/v1/stats``) and logged;
- any other field, documented by OpenAI (``openai.types``: the SDK's own request types) or
  not, is a 400 naming it: a 200 that did nothing would be a silent no-op.

A handler that decides to leave part of a field out (``/v1/responses``: a hosted tool the
server cannot run, a reasoning summary from a model that writes no reasoning items) lists
it the same way with ``ignore``. ``ignored(request)`` is what the answer carries.
"""

from __future__ import annotations

import re
import threading
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params
from openai.types.responses import response_create_params
from openai.types.shared import ReasoningEffort
from pydantic import BaseModel, TypeAdapter, ValidationError

from leyline_agent.logs import get_logger
from leyline_agent.server.errors import RequestError

__all__ = [
    "HINTS",
    "Ignored",
    "IgnoredCounts",
    "fields_check",
    "check_effort",
    "ignore",
    "ignored",
]

log = get_logger(__name__)
SCOPE_IGNORED = "leyline.ignored"

_USER = "an end-user id for OpenAI's abuse monitoring; this server does not use it"
_TIER = "one service tier here"
_RETENTION = "the prefix cache keeps rows by LRU; it takes no retention setting"
# OpenAI's documented hints, per route: accepted, acted on by nothing, listed as ignored.
HINTS: Mapping[str, Mapping[str, str]] = {
    "chat": {
        "user": _USER,
        "safety_identifier": _USER,
        "metadata": "chat completions are not stored here, so their metadata is not kept",
        "store": "chat completions are not stored here",
        "service_tier": _TIER,
        "prompt_cache_retention": _RETENTION,
        "prompt_cache_options": _RETENTION,
        "prediction": "predicted outputs only speed decoding up; not used here",
        "verbosity": "the served model has no verbosity control",
    },
    "completions": {"user": _USER},
    "responses": {
        "user": _USER,
        "safety_identifier": _USER,
        "service_tier": _TIER,
        "prompt_cache_retention": _RETENTION,
        "prompt_cache_options": _RETENTION,
        "stream_options": "stream obfuscation is not used here",
        "client_metadata": "Codex's client metadata, for OpenAI's logs; not used here",
    },
}


@dataclass(frozen=True, slots=True)
class Ignored:
    field: str
    reason: str

    def wire(self) -> dict[str, str]:
        return {"field": self.field, "reason": self.reason}


@dataclass(slots=True)
class IgnoredCounts:
    """Ignored fields per tenant (``/leyline/v1/stats``' ``ignored_fields``), keyed by the
    field without list indices (``tools[3]`` counts as ``tools``)."""

    _by_tenant: dict[str, Counter[str]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, tenant: str, names: Iterable[str]) -> None:
        with self._lock:
            self._by_tenant.setdefault(tenant, Counter()).update(names)

    def of(self, tenant: str) -> dict[str, int]:
        with self._lock:
            return dict(sorted(self._by_tenant.get(tenant, Counter()).items()))


def _documented(*params: type) -> frozenset[str]:
    """The request fields OpenAI's SDK types name (``TypedDict`` keys, inherited ones too)."""
    return frozenset(k for p in params for k in (*p.__required_keys__, *p.__optional_keys__))


DOCUMENTED = {
    "chat": _documented(
        chat_create_params.CompletionCreateParamsStreaming,
        chat_create_params.CompletionCreateParamsNonStreaming,
    ),
    "completions": _documented(
        completion_create_params.CompletionCreateParamsStreaming,
        completion_create_params.CompletionCreateParamsNonStreaming,
    ),
    "responses": _documented(
        response_create_params.ResponseCreateParamsStreaming,
        response_create_params.ResponseCreateParamsNonStreaming,
    ),
}


_EFFORT = TypeAdapter(ReasoningEffort)


def check_effort(value: Any, where: str) -> None:
    """A reasoning effort OpenAI's types know (``ReasoningEffort``), else a 400 naming it."""
    try:
        _EFFORT.validate_python(value)
    except ValidationError as e:
        raise RequestError(f"{value!r} is not a reasoning effort", where) from e


def ignore(request: Request, notes: Iterable[Ignored]) -> None:
    """List ``notes`` in the request's answer (``ignored``), count and log them."""
    notes = list(notes)
    if not notes:
        return
    request.scope.setdefault(SCOPE_IGNORED, []).extend(notes)
    from leyline_agent.server.tenants import namespace  # tenants imports the routes' state

    tenant = namespace(request).tenant
    counts = getattr(request.app.state.leyline, "ignored", None)
    if counts is not None:
        counts.add(tenant, (re.sub(r"\[\d+\]", "", n.field) for n in notes))
    for n in notes:
        log.info("request field ignored", route=request.url.path, field=n.field, reason=n.reason)


def ignored(request: Request) -> list[dict[str, str]]:
    """What the answer's ``leyline.ignored`` lists (empty: nothing was ignored)."""
    return [n.wire() for n in request.scope.get(SCOPE_IGNORED, ())]


def fields_notes(route: str, body: Any, own: Iterable[str]) -> list[Ignored]:
    """The hints of ``body`` (a route's JSON body) to list as ignored; ``RequestError`` naming
    the first field that is neither the route's own (``own``) nor a hint."""
    if not isinstance(body, dict):
        return []  # the route's model refuses it, naming the body
    own, hints, notes = frozenset(own), HINTS[route], []
    for name, value in body.items():
        if name in own:
            if name in hints and value is not None:
                notes.append(Ignored(name, hints[name]))
            continue
        if name in hints:
            if value is not None:
                notes.append(Ignored(name, hints[name]))
            continue
        if name in DOCUMENTED[route]:
            raise RequestError(f"{name} is not supported by this server", name)
        raise RequestError(f"unknown field {name!r} (not a field of this route)", name)
    return notes


def fields_check(route: str, model: type[BaseModel]) -> Callable[[Request], Awaitable[None]]:
    """The route dependency that checks a body's fields against ``model`` (the route's own
    request model) and OpenAI's lists for ``route`` (``fields_notes``), noting the hints."""
    own = frozenset(model.model_fields)

    async def check(request: Request) -> None:
        try:
            body = await request.json()
        except ValueError:
            return  # the route's body model names the problem
        ignore(request, fields_notes(route, body, own))

    return check
