"""Who is asking: API keys and tenants, the ``Host`` allowlist, each request's namespace.

- ``ApiKeys``: each key belongs to one tenant. ``--api-key KEY`` gives the key a tenant of
  its own, named by a stable, non-secret id derived from the key (``key_tenant``). A key file
  holds one key per line, optionally ``KEY TENANT``: keys that name the same tenant share
  one cache namespace (the opt-in for a trusted deployment); blank lines and ``#`` comments
  are skipped.
- ``BearerAuth`` (pure ASGI): with keys configured, every path but ``/health`` needs
  ``Authorization: Bearer KEY`` (401 ``AuthenticationError`` otherwise); the tenant is put
  in the request's scope. Without keys every request is ``DEFAULT_TENANT``.
- ``HostAllowlist`` (pure ASGI): a browser page on an attacker's domain can resolve that
  domain to 127.0.0.1 (DNS rebinding) and talk to a loopback server; it still sends its
  own ``Host``. So only ``localhost``, ``127.0.0.1``, ``[::1]`` (any port) and the names
  given are answered; anything else gets 400 naming ``host``.
- ``session_header`` (the routers' dependency): the ``X-Leyline-Session`` header, checked
  once per request (400 naming it) and kept in the request's scope.
- ``namespace(request, body_session)``: ``Namespace(tenant, session)`` of a request; the
  session comes from the checked header or a directive's ``session`` field.
- ``key_owner(request)``: which key sent it (``key_tenant`` of the key: stable, not
  secret; ``""`` without keys). Anonymous conversations are matched per key
  (``front/conversations.py``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from leyline_agent.http import guards
from leyline_agent.http.asgi import header
from leyline_agent.namespaces import (
    DEFAULT_TENANT,
    SESSION_HEADER,
    Namespace,
    named_namespace,
)
from leyline_agent.server.errors import error_response

__all__ = [
    "ApiKeys",
    "BearerAuth",
    "HostAllowlist",
    "LOOPBACK_HOSTS",
    "key_owner",
    "key_tenant",
    "namespace",
    "read_key_file",
    "session_header",
]

SCOPE_TENANT = "leyline.tenant"
SCOPE_KEY = "leyline.key"  # key_tenant(the presented key), once it is known to be valid
SCOPE_SESSION = "leyline.session"  # the checked X-Leyline-Session header (or None)
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")
OPEN_PATHS = frozenset({"/health"})


def key_tenant(key: str) -> str:
    """The tenant of a key given without one: ``key-`` + 12 hex digits of its SHA-256."""
    return "key-" + hashlib.sha256(key.encode("utf-8")).hexdigest()[:12]


def read_key_file(path: str | Path) -> list[tuple[str, str | None]]:
    """``(key, tenant or None)`` per line of a key file (``ValueError`` naming the line)."""
    out: list[tuple[str, str | None]] = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        cols = line.split()
        if not cols or cols[0].startswith("#"):
            continue
        if len(cols) > 2:
            raise ValueError(f"{path}:{n}: expected 'KEY' or 'KEY TENANT', got {len(cols)} columns")
        out.append((cols[0], cols[1] if len(cols) == 2 else None))
    return out


@dataclass(frozen=True, slots=True)
class ApiKeys:
    """Keys (as SHA-256 digests, ``http.guards.key_digests``) and their tenants."""

    digests: tuple[bytes, ...] = ()
    tenants: tuple[str, ...] = ()

    @classmethod
    def build(cls, keys: Iterable[str | tuple[str, str | None]] = ()) -> ApiKeys:
        """From ``"KEY"`` or ``("KEY", tenant or None)`` items; a key twice with two
        tenants is an error."""
        tenants: dict[str, str] = {}
        for item in keys:
            key, tenant = (item, None) if isinstance(item, str) else item
            if not key or any(c.isspace() for c in key) or not key.isprintable():
                raise ValueError("api key: must be printable, without spaces, not empty")
            tenant = tenant or key_tenant(key)
            if tenants.setdefault(key, tenant) != tenant:
                raise ValueError(f"api key given twice with tenants {tenants[key]!r}, {tenant!r}")
        return cls(guards.key_digests(tenants), tuple(tenants.values()))

    def __bool__(self) -> bool:
        return bool(self.digests)

    def tenant(self, presented: bytes) -> str | None:
        """The tenant of ``presented``, compared with every key (``http.guards.key_index``)."""
        i = guards.key_index(presented, self.digests)
        return None if i is None else self.tenants[i]


class BearerAuth:
    """401 unless ``Authorization: Bearer KEY`` names a configured key (see module doc)."""

    def __init__(self, app: ASGIApp, keys: ApiKeys) -> None:
        self.app, self.keys = app, keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        tenant: str | None = DEFAULT_TENANT
        owner = ""
        if self.keys and scope.get("path") not in OPEN_PATHS:
            token = guards.bearer_token(header(scope.get("headers", ()), b"authorization"))
            tenant = self.keys.tenant(token) if token is not None else None
            if token is None or tenant is None:
                problem = guards.MISSING_KEY if token is None else guards.BAD_KEY
                await guards.send_error(send, guards.authentication_error(problem))
                return
            owner = key_tenant(token.decode("utf-8", "replace"))
        scope[SCOPE_TENANT] = tenant
        scope[SCOPE_KEY] = owner
        await self.app(scope, receive, send)


def _split_host(value: str) -> tuple[str, str | None]:
    """``"[::1]:8080"`` -> ``("[::1]", "8080")``; ``"Example.COM."`` -> ``("example.com", None)``."""
    value = value.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        name, rest = value[: end + 1], value[end + 1 :]
        port = rest[1:] if rest.startswith(":") else None
    else:
        name, sep, port_s = value.rpartition(":")
        name, port = (name, port_s) if sep else (port_s, None)
    return name.rstrip("."), port


class HostAllowlist:
    """400 naming ``host`` unless the ``Host`` header is loopback or one of ``names``.

    A name given with a port (``example.com:8080``) matches that port only; without, any.
    """

    def __init__(self, app: ASGIApp, names: Iterable[str] = ()) -> None:
        self.app = app
        self.allowed: set[tuple[str, str | None]] = {(h, None) for h in LOOPBACK_HOSTS}
        self.allowed |= {_split_host(n) for n in names if n.strip()}

    def allows(self, host: str) -> bool:
        name, port = _split_host(host)
        return bool(name) and ((name, None) in self.allowed or (name, port) in self.allowed)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        host = (header(scope.get("headers", ()), b"host") or b"").decode("latin-1")
        if not self.allows(host):
            shown = host.encode("unicode_escape").decode("ascii")[:100]
            response = error_response(
                400,
                "HostNotAllowedError",
                f"host: {shown!r} is not an allowed Host for this server "
                "(leyline serve --allowed-host NAME adds one)",
                "host",
            )
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


def session_header(request: Request) -> str | None:
    """The ``X-Leyline-Session`` header, checked (400 naming it) on the first call for a
    request and kept in its scope; later calls for the same request return that value."""
    if SCOPE_SESSION in request.scope:
        return request.scope[SCOPE_SESSION]
    session = guards.session_header(request.headers.get(SESSION_HEADER))
    request.scope[SCOPE_SESSION] = session
    return session


def namespace(request: Request, body_session: str | None = None) -> Namespace:
    """The request's ``Namespace``: its key's tenant, and the session named by the header
    (``session_header``'s checked value) or by the body's ``session`` field (both given and
    different: 400 naming ``session``)."""
    tenant = request.scope.get(SCOPE_TENANT, DEFAULT_TENANT)
    return named_namespace(body_session, session_header(request), tenant)


def key_owner(request: Request) -> str:
    """The key that sent ``request`` (module doc); ``""`` on a server without keys."""
    return str(request.scope.get(SCOPE_KEY, ""))
