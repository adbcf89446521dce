"""``leyline serve``: load the engine, build the app, run uvicorn (loopback by default).

The arguments are registered by ``leyline_agent.server.cli``; this module only runs them.
"""

from __future__ import annotations

import argparse
import errno
import gc
import ipaddress
import json
import socket
import sys

import structlog

from leyline_agent.errors import LeylineError, RuntimeUnavailableError

log = structlog.get_logger(__name__)

__all__ = ["DEFAULT_HOST", "DEFAULT_PORT", "build_app", "build_server", "serve"]

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 30000


class ArgumentError(LeylineError, ValueError):
    """A ``leyline serve`` argument that cannot be used (names the option)."""


def build_app(args: argparse.Namespace):  # -> FastAPI (imported lazily: torch comes with it)
    """Load the engine named by ``args`` and wrap it in the app."""
    engine_kind = getattr(args, "engine", "embedded") or "embedded"
    if engine_kind != "embedded":
        raise RuntimeUnavailableError(
            f"--engine {engine_kind}: `leyline serve` runs the embedded engine; for SGLang, "
            "launch SGLang's own server with the Leyline plugin installed"
        )
    from leyline_agent.directives.tool_prompt import set_setting
    from leyline_agent.engine.engine import Engine
    from leyline_agent.server.app import create_app
    from leyline_agent.server.inputs import DEFAULT_MAX_MESSAGES
    from leyline_agent.server.key_limits import (
        DEFAULT_KEY_BODY_BYTES,
        DEFAULT_KEY_REFUSALS_PER_S,
        DEFAULT_KEY_REQUESTS,
        KeyLimits,
    )
    from leyline_agent.server.limits import DEFAULT_MAX_BODY_BYTES
    from leyline_agent.server.schema_work import (
        DEFAULT_MAX_SCHEMA_BYTES,
        DEFAULT_MAX_TOOLS,
        SchemaLimits,
    )
    from leyline_agent.server.worker import DEFAULT_QUEUE_TIMEOUT_S

    kwargs = {
        "dtype": getattr(args, "dtype", "float32") or "float32",
        "device": getattr(args, "device", None) or "cpu",
        "prefix_cache": not getattr(args, "no_prefix_cache", False),
        "packed_linears": not getattr(args, "no_packed_linears", False),
    }
    cache_tokens = getattr(args, "cache_tokens", None)
    if cache_tokens is not None:
        kwargs["cache_budget_tokens"] = cache_tokens
    pin_ttl = getattr(args, "pin_ttl_s", None)
    if pin_ttl is not None:
        if not pin_ttl >= 0:
            raise ArgumentError(f"--pin-ttl-s: {pin_ttl} must be >= 0")
        kwargs["pin_ttl_s"] = pin_ttl
    repair_budget = getattr(args, "repair_budget", None)
    if repair_budget is not None:
        if not 0 <= repair_budget <= 1:
            raise ArgumentError(f"--repair-budget: {repair_budget} must be in [0, 1]")
        kwargs["repair_budget"] = repair_budget
    share = getattr(args, "tenant_cache_share", None)
    if share is not None:
        if not 0 < share <= 1:
            raise ArgumentError(f"--tenant-cache-share: {share} must be in (0, 1]")
        kwargs["tenant_cache_share"] = share
    keys = api_keys(args)
    limits = {
        "max_body_bytes": getattr(args, "max_body_bytes", None) or DEFAULT_MAX_BODY_BYTES,
        "max_prompt_tokens": getattr(args, "max_prompt_tokens", None),
        "max_tokens_cap": getattr(args, "max_tokens_cap", None),
        "queue_timeout_s": getattr(args, "queue_timeout_s", DEFAULT_QUEUE_TIMEOUT_S),
    }
    for name, value in limits.items():
        if value is not None and not value > 0:
            raise ArgumentError(f"--{name.replace('_', '-')}: {value} must be > 0")
    concurrency = getattr(args, "concurrency", None)
    if concurrency is not None and concurrency < 1:
        raise ArgumentError(f"--concurrency: {concurrency} must be >= 1")
    max_messages = getattr(args, "max_messages", None) or DEFAULT_MAX_MESSAGES
    if max_messages < 1:
        raise ArgumentError(f"--max-messages: {max_messages} must be >= 1")
    schema_limits = SchemaLimits(
        max_tools=getattr(args, "max_tools", None) or DEFAULT_MAX_TOOLS,
        max_schema_bytes=getattr(args, "max_schema_bytes", None) or DEFAULT_MAX_SCHEMA_BYTES,
    )
    if schema_limits.max_tools < 1 or schema_limits.max_schema_bytes < 1:
        raise ArgumentError("--max-tools / --max-schema-bytes: must be >= 1")
    try:
        key_limits = KeyLimits(
            max_requests=getattr(args, "max_key_requests", None) or DEFAULT_KEY_REQUESTS,
            max_body_bytes=getattr(args, "max_key_body_bytes", None) or DEFAULT_KEY_BODY_BYTES,
            refusals_per_s=getattr(args, "max_key_refusals_per_s", None)
            or DEFAULT_KEY_REFUSALS_PER_S,
        )
    except ValueError as e:
        raise ArgumentError(
            f"--max-key-requests / --max-key-body-bytes / --max-key-refusals-per-s: {e}"
        ) from e
    engine = Engine.from_pretrained(args.model, **kwargs)
    if getattr(args, "tool_format", None):  # the model folder's setting, overridden
        set_setting(engine.tokenizer, args.tool_format)
    return create_app(
        engine,
        served_model_name=getattr(args, "served_model_name", None),
        aliases=[str(args.model)],
        api_keys=keys,
        allowed_hosts=allowed_hosts(args),
        client_edits=getattr(args, "client_edits", None) or "amortize",
        concurrency=concurrency,
        max_messages=max_messages,
        schema_limits=schema_limits,
        key_limits=key_limits,
        **limits,
    )


def api_keys(args: argparse.Namespace):  # -> ApiKeys
    """``--api-key`` and ``--api-key-file``, checked (``ArgumentError`` naming the option)."""
    from leyline_agent.server.tenants import ApiKeys, read_key_file

    keys: list[tuple[str, str | None]] = [(k, None) for k in getattr(args, "api_key", None) or []]
    for path in getattr(args, "api_key_file", None) or []:
        try:
            keys += read_key_file(path)
        except (OSError, ValueError) as e:
            raise ArgumentError(f"--api-key-file: {e}") from e
    try:
        return ApiKeys.build(keys)
    except ValueError as e:
        raise ArgumentError(f"--api-key: {e}") from e


def allowed_hosts(args: argparse.Namespace) -> list[str] | None:
    """The Host allowlist: on for a loopback bind or with ``--allowed-host``, else None."""
    names = list(getattr(args, "allowed_host", None) or [])
    from leyline_agent.engine.memory import tune_allocator

    log.info("allocator", **tune_allocator())  # before the model and the threads (memory.py)
    host = getattr(args, "host", None) or DEFAULT_HOST
    return names if names or _is_loopback(host) else None


def build_server(args: argparse.Namespace):  # -> uvicorn.Server
    """The uvicorn server ``leyline serve`` runs: loopback unless ``--host`` says otherwise;
    its shutdown bounded by ``--shutdown-timeout-s`` (``shutdown.DrainingServer``)."""
    import uvicorn

    from leyline_agent.engine.engine import GenerationStopped
    from leyline_agent.server.shutdown import DEFAULT_SHUTDOWN_TIMEOUT_S, DrainingServer

    host = getattr(args, "host", None) or DEFAULT_HOST
    port = DEFAULT_PORT if getattr(args, "port", None) is None else int(args.port)
    timeout = getattr(args, "shutdown_timeout_s", None)
    timeout = DEFAULT_SHUTDOWN_TIMEOUT_S if timeout is None else timeout
    if not timeout >= 0:
        raise ArgumentError(f"--shutdown-timeout-s: {timeout} must be >= 0")
    app = build_app(args)
    engine = app.state.leyline.worker.engine
    log.info("serving", model=str(args.model), host=host, port=port)
    level = str(getattr(args, "log_level", "warning") or "warning").lower()
    # uvicorn's own lines go through the CLI's logging set-up (``--json-logs``): no
    # log_config of its own; its access log is ``observability.AccessLog``'s
    config = uvicorn.Config(
        app, host=host, port=port, log_level=level, access_log=False, log_config=None
    )
    worker = app.state.leyline.worker

    def on_deadline() -> None:  # the engine stops; the requests it held are answered now
        engine.stop_generations()
        worker.abandon(GenerationStopped("the server is shutting down"))

    return DrainingServer(config, timeout_s=timeout, on_deadline=on_deadline)


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port``; a busy or unusable address is a one-line
    ``ArgumentError`` naming ``--port`` / ``--host`` (not uvicorn's errno traceback)."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise ArgumentError(f"--host: cannot resolve {host!r}: {e.strerror}") from e
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise ArgumentError(
                f"--port: {host}:{port} is already in use (another server on it?); "
                "stop it or pick another --port"
            ) from e
        raise ArgumentError(f"--host/--port: cannot bind {host}:{port}: {e.strerror}") from e
    return sock


def serve(args: argparse.Namespace) -> int:
    """Bind first (a busy port fails before the model loads), then load and build the app,
    say where it serves, and run until SIGINT/SIGTERM; the app then closes its worker."""
    host = getattr(args, "host", None) or DEFAULT_HOST
    port = DEFAULT_PORT if getattr(args, "port", None) is None else int(args.port)
    sock = bind(host, port)
    try:
        server = build_server(args)
        if not _is_loopback(host):
            log.warning(
                "not loopback: anyone who can reach this address can use the server", host=host
            )
        url = f"http://{host}:{port}"
        model_id = server.config.app.state.leyline.model.id
        line = f"leyline: serving {model_id} at {url} (OpenAI base URL {url}/v1)"
        if getattr(args, "json_logs", False):  # every line JSON
            line = json.dumps({"event": "serving", "model": model_id, "url": url})
        print(line, file=sys.stderr, flush=True)
        # What start-up made (modules, the model) lives as long as the server: frozen out of
        # the collector, a full collection a request's allocations trigger scans only what
        # requests made (scanning it all took 1.7 s here, the GIL held: every stream stalled)
        gc.collect()
        gc.freeze()
        server.run(sockets=[sock])
    finally:
        sock.close()
    return 0


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"
