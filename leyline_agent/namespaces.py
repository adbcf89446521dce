"""Cache namespaces: whose KV rows a request may reuse (no torch, no runtime imports).

The rule (docs/exactness.md states it for users):

- Rows from an exact prefill depend on their tokens only. They are shared by token
  identity, but only inside one **tenant** (an API key of ``leyline serve``; ``""`` when the
  server has no keys). Tenants never share rows, so ``cached_tokens`` tells nobody anything
  about another tenant's prompts.
- Rows whose KV came from an AMORTIZE splice (the rotated tail, and every row computed
  after a spliced row) depend on history: they belong to the **session** that made the
  splice. A request reuses them only if it names the same session (``X-Leyline-Session``
  header, or a directive's ``session`` field). Requests that name no session share one
  anonymous session per tenant, which no named session ever sees, and vice versa.
- Inside a namespace the latest write is what is served for its tokens: a FORGET writes
  exact rows and they replace the session's spliced ones.
- Session ids that start with ``SERVER_SESSION_PREFIX`` are the server's own (the namespace
  of an anonymous conversation, ``front/conversations.py``): a client may not name one
  (``check_session_id`` refuses it, naming the field), so no client can write rows into,
  or be served from, a conversation the server made for someone else.

``Namespace.key`` is the string form used where an engine wants one opaque extra key (the
SGLang plugin's radix ``extra_key``).
"""

from __future__ import annotations

from dataclasses import dataclass

from leyline_agent.errors import RequestError

__all__ = [
    "ANONYMOUS",
    "DEFAULT_TENANT",
    "Namespace",
    "SERVER_SESSION_PREFIX",
    "SESSION_HEADER",
    "check_session_id",
    "named_namespace",
]

SESSION_HEADER = "X-Leyline-Session"
DEFAULT_TENANT = ""
SERVER_SESSION_PREFIX = "leyline-conv-"  # server-made session ids; refused from clients
_MAX_ID = 256


@dataclass(frozen=True, slots=True)
class Namespace:
    """``tenant`` owns the exact rows; ``(tenant, session)`` owns spliced rows.

    ``session=None`` is the tenant's anonymous session.
    """

    tenant: str = DEFAULT_TENANT
    session: str | None = None

    @property
    def exact(self) -> tuple[str, None]:
        """The tag of this tenant's exact (token-identity) rows."""
        return (self.tenant, None)

    @property
    def spliced(self) -> tuple[str, str]:
        """The tag of this session's spliced rows (the anonymous session has its own)."""
        return (self.tenant, self.session if self.session is not None else "")

    @property
    def key(self) -> str:
        """One opaque string per (tenant, session), for engines with a single extra key."""
        sid = "anon:" if self.session is None else f"s:{self.session}"
        return f"leyline/{len(self.tenant)}:{self.tenant}/{sid}"


ANONYMOUS = Namespace()


def check_session_id(
    value: object, where: str = "session", *, server_made: bool = False
) -> str | None:
    """``value`` as a session id, or ``None``; ``ValueError`` naming ``where`` otherwise.
    A client's id (the default) may not start with ``SERVER_SESSION_PREFIX``; the server's
    own calls with a session it made pass ``server_made=True``."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise ValueError(f"{where}: must be a string, got {type(value).__name__}")
    if not value or len(value) > _MAX_ID or not value.isprintable():
        raise ValueError(f"{where}: must be 1 to {_MAX_ID} printable characters")
    if not server_made and value.startswith(SERVER_SESSION_PREFIX):
        raise ValueError(
            f"{where}: session ids starting with {SERVER_SESSION_PREFIX!r} are the server's "
            "own (anonymous conversations); name a session of your own"
        )
    return value


def named_namespace(
    body_session: object,
    header_session: object,
    tenant: str = DEFAULT_TENANT,
    *,
    server_made: bool = False,
) -> Namespace:
    """The namespace a request names: the ``X-Leyline-Session`` header or the body's
    ``session`` (both given: they must agree); neither: the tenant's anonymous session.
    ``RequestError`` (400) naming the field at fault (``session`` or the header).
    ``server_made``: the server's own request in a session it made (``check_session_id``)."""
    try:
        header = check_session_id(header_session, SESSION_HEADER, server_made=server_made)
        body = check_session_id(body_session, "session", server_made=server_made)
    except ValueError as e:
        field, _, message = str(e).partition(": ")
        raise RequestError(message, field) from e
    if header is not None and body is not None and header != body:
        raise RequestError(
            f"the {SESSION_HEADER} header ({header!r}) and the body ({body!r}) "
            "name different sessions",
            "session",
        )
    return Namespace(tenant=tenant, session=header if header is not None else body)
