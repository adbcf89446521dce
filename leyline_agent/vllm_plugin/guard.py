"""The Leyline front door attached to vLLM's app (``front.door.FrontDoor``,
``front.pin_report.PinReport``): what the door reads of vLLM.

- **Keys**: the ones vLLM itself checks (``--api-key``, repeatable, over ``VLLM_API_KEY``;
  ``api_keys``), as digests in ``app.state`` (``KEYS_STATE``, set by ``init_state``; before
  it, the environment's). vLLM checks them only on its own path prefixes
  (``VLLM_GUARDED``): a request there without a valid key is passed on unread, and vLLM
  answers its 401; the Leyline routes are checked by the door.
- **Namespaces**: vLLM separates prefix caches by the body's ``cache_salt``; Leyline's
  namespaces are salts of their own (``namespace.salt_for``), which the scheduler routes
  (``namespace.route_salt``). A client's salt of that form is refused, since it would be
  served other clients' rows.
- **State**: the directive route (``app.state.leyline``: stats, pins), the chat front
  (``FRONT_STATE``) and the chat turns' splices by source (``SOURCES_STATE``, made on first
  use).
"""

from __future__ import annotations

import os
from argparse import Namespace as Args
from typing import TYPE_CHECKING

from leyline_agent.front.chat_proxy import ChatFront
from leyline_agent.front.door import BODY_KEY, PinWatch
from leyline_agent.http import guards
from leyline_agent.http.asgi import Scope
from leyline_agent.metrics import SpliceSources
from leyline_agent.namespaces import Namespace
from leyline_agent.vllm_plugin.namespace import is_leyline_salt, salt_for
from leyline_agent.wire import StatsResponse

if TYPE_CHECKING:
    from starlette.datastructures import State

__all__ = ["BODY_KEY", "FRONT_STATE", "KEYS_STATE", "VLLM", "VLLMAttachment", "api_keys"]

KEYS_STATE = "leyline_api_keys"  # app.state: the key digests (set by init_state)
FRONT_STATE = "leyline_chat"  # app.state: the ``front.chat_proxy.ChatFront`` (set by init_state)
SOURCES_STATE = "leyline_splice_sources"  # app.state: ``metrics.SpliceSources``
VLLM_GUARDED = ("/v1", "/v2", "/inference", "/cohere")  # vLLM's AuthenticationMiddleware


def api_keys(args: Args | None) -> tuple[bytes, ...]:
    """The keys vLLM itself checks: ``--api-key`` (repeatable) over ``VLLM_API_KEY``."""
    given: str | list[str] | None = getattr(args, "api_key", None)
    keys = [given] if isinstance(given, str) else list(given or [])
    return guards.key_digests(k for k in keys or [os.environ.get("VLLM_API_KEY", "")] if k)


def _state(scope: Scope) -> State | None:
    """vLLM's ``app.state`` (None before the app is set in the scope)."""
    return getattr(scope.get("app"), "state", None)


class VLLMAttachment:
    """``front.door.EngineAttachment`` over vLLM's app (module doc)."""

    guarded = VLLM_GUARDED
    salt_field = "cache_salt"

    def keys(self, scope: Scope) -> tuple[bytes, ...]:
        keys = getattr(_state(scope), KEYS_STATE, None)
        return api_keys(None) if keys is None else keys

    def chat(self, scope: Scope) -> ChatFront | None:
        return getattr(_state(scope), FRONT_STATE, None)

    def pins(self, scope: Scope) -> PinWatch | None:
        return getattr(_state(scope), "leyline", None)

    async def stats(self, scope: Scope) -> StatsResponse | None:
        route = getattr(_state(scope), "leyline", None)
        return None if route is None else StatsResponse.model_validate(await route.stats())

    def sources(self, scope: Scope) -> SpliceSources:
        state = _state(scope)
        sources = getattr(state, SOURCES_STATE, None)
        if sources is None:
            sources = SpliceSources()
            setattr(state, SOURCES_STATE, sources)
        return sources

    def salt_for(self, ns: Namespace) -> str:
        return salt_for(ns)

    def is_leyline_salt(self, value: object) -> bool:
        return is_leyline_salt(value)


VLLM = VLLMAttachment()
