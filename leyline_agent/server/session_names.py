"""A session named by what a client already sends, where ``X-Leyline-Session`` names none.

OpenAI's ``prompt_cache_key`` and Codex's ``session-id`` header name a conversation for the
client's own reasons (a cache routing key, its thread id). ``name_session`` makes such a
value the request's session, checked by the same rule as the header
(``namespaces.check_session_id``, a 400 naming the field it came from), and kept where the
header's checked value is kept (``tenants.session_header``), so every later
``namespace(request)`` of the request sees it. An ``X-Leyline-Session`` header always wins.
"""

from __future__ import annotations

from starlette.requests import Request

from leyline_agent.namespaces import check_session_id
from leyline_agent.server.errors import RequestError
from leyline_agent.server.tenants import SCOPE_SESSION, session_header

__all__ = ["name_session"]


def name_session(request: Request, value: object, where: str) -> None:
    """Name the request's session by ``value`` (``where``: the field or header it came
    from) unless a session is already named; ``None`` names nothing."""
    if value is None or session_header(request) is not None:
        return
    try:
        session = check_session_id(value, where)
    except ValueError as e:
        raise RequestError(str(e).partition(": ")[2] or str(e), where) from e
    request.scope[SCOPE_SESSION] = session
