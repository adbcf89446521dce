"""``leyline serve``: load the engine, build the app, run uvicorn (loopback by default).

The arguments are registered by ``leyline_agent.runtime.cli``; this module only runs them.
"""

from __future__ import annotations

import argparse
import ipaddress
import sys

import structlog

from leyline_agent.errors import RuntimeUnavailableError

log = structlog.get_logger(__name__)

__all__ = ["DEFAULT_HOST", "DEFAULT_PORT", "build_app", "build_server", "serve"]

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 30000


def build_app(args: argparse.Namespace):  # -> FastAPI (imported lazily: torch comes with it)
    """Load the engine named by ``args`` and wrap it in the app."""
    engine_kind = getattr(args, "engine", "embedded") or "embedded"
    if engine_kind != "embedded":
        raise RuntimeUnavailableError(
            f"--engine {engine_kind}: `leyline serve` runs the embedded engine; for SGLang, "
            "launch SGLang's own server with the Leyline plugin installed"
        )
    from leyline_agent.runtime.engine import Engine
    from leyline_agent.server.app import create_app

    kwargs = {
        "dtype": getattr(args, "dtype", "float32") or "float32",
        "device": getattr(args, "device", None) or "cpu",
        "prefix_cache": not getattr(args, "no_prefix_cache", False),
    }
    cache_tokens = getattr(args, "cache_tokens", None)
    if cache_tokens is not None:
        kwargs["cache_budget_tokens"] = cache_tokens
    engine = Engine.from_pretrained(args.model, **kwargs)
    return create_app(
        engine,
        served_model_name=getattr(args, "served_model_name", None),
        aliases=[str(args.model)],
    )


def build_server(args: argparse.Namespace):  # -> uvicorn.Server
    """The uvicorn server ``leyline serve`` runs: loopback unless ``--host`` says otherwise."""
    import uvicorn

    host = getattr(args, "host", None) or DEFAULT_HOST
    port = DEFAULT_PORT if getattr(args, "port", None) is None else int(args.port)
    app = build_app(args)
    log.info("serving", model=str(args.model), host=host, port=port)
    level = str(getattr(args, "log_level", "warning") or "warning").lower()
    return uvicorn.Server(
        uvicorn.Config(app, host=host, port=port, log_level=level, access_log=False)
    )


def serve(args: argparse.Namespace) -> int:
    """Run the server until SIGINT/SIGTERM; the app then closes its scheduler."""
    server = build_server(args)
    host, port = server.config.host, server.config.port
    if not _is_loopback(host):
        log.warning("not loopback: anyone who can reach this address can use the server", host=host)
    url = f"http://{host}:{port}"
    print(
        f"leyline: serving {server.config.app.state.leyline.model.id} at {url} (OpenAI base URL {url}/v1)",
        file=sys.stderr,
        flush=True,
    )
    server.run()
    return 0


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"
