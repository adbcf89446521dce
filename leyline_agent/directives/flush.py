"""``FlushResponse``: the answer of ``POST /leyline/v1/flush`` on every Leyline server.

A flush empties the caller's part of the prefix cache (on ``leyline serve`` its tenant's;
the vLLM plugin has one tenant, ``""``): every cached row no request in flight holds is
freed (``flushed_tokens``); rows a request in flight holds stay until it ends
(``kept_tokens``). Pins, server-side conversations and stored Responses of the tenant are
dropped too (the vLLM plugin keeps no pins, and no stored responses: 0). No counter changes.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

__all__ = ["FlushResponse"]


class FlushResponse(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    tenant: str
    flushed_tokens: int  # cached rows freed
    kept_tokens: int  # the tenant's rows still cached: held by a request in flight
    dropped_pins: int
    dropped_conversations: int
    dropped_responses: int = 0  # stored Responses (/v1/responses)
