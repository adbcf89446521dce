"""``leyline serve``: its arguments and its handler.

``--engine embedded`` (the default) runs ``server.main.serve``; ``--engine sglang`` hands
over to SGLang's own server with the plugin (``sglang_plugin.launch``), refusing by name the
flags only the embedded server has (``_EMBEDDED_ONLY``: SGLang's server would not read them). Registration imports no torch; the handler imports the heavy
modules when it runs.
"""

from __future__ import annotations

import argparse

from leyline_agent.directives.pin_table import DEFAULT_TTL_S
from leyline_agent.directives.repair import DEFAULT_BUDGET

__all__ = ["add_serve_arguments", "register"]


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="local Hugging Face model directory")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    p.add_argument("--port", type=int, default=30000, help="TCP port")
    p.add_argument(
        "--dtype", choices=["float32", "bfloat16"], default="float32", help="weights and KV dtype"
    )
    p.add_argument(
        "--device", choices=["cpu", "cuda", "auto"], default="auto", help="auto: cuda if available"
    )
    p.add_argument(
        "--cache-tokens",
        type=int,
        default=_EMBEDDED_ONLY["cache_tokens"],
        help="prefix-cache budget in tokens (LRU eviction)",
    )
    p.add_argument("--no-prefix-cache", action="store_true", help="disable the radix prefix cache")
    p.add_argument(
        "--no-packed-linears",
        action="store_true",
        help="no oneDNN-packed copy of the linear weights (saves their memory; batched "
        "decode on CPU is slower)",
    )
    p.add_argument(
        "--pin-ttl-s",
        type=float,
        default=_EMBEDDED_ONLY["pin_ttl_s"],
        help="keep each session's latest splice result from eviction until its next request "
        "or this many seconds (0: no pinning; pins hold at most half the cache; default 300)",
    )
    p.add_argument(
        "--served-model-name", default=None, help="model id in /v1/models (default: folder name)"
    )
    p.add_argument(
        "--engine",
        choices=["embedded", "sglang"],
        default="embedded",
        help="embedded transformers engine, or SGLang with the Leyline plugin",
    )
    p.add_argument(
        "--client-edits",
        choices=["amortize", "forget", "repair", "off"],
        default="amortize",
        help="chat requests that edit a cached conversation in place (a framework's own "
        "context edits) are spliced: amortize (in place; the tail keeps its attention to the "
        "old content), forget (exact re-prefill from the edit), repair (amortize, then a few "
        "tail rows recomputed: --repair-budget), off (plain prefix cache). "
        'Default amortize; a request overrides it with {"leyline": {"client_edits": ...}}',
    )
    p.add_argument(
        "--repair-budget",
        type=float,
        default=_EMBEDDED_ONLY["repair_budget"],
        help="mode repair: the fraction of an edit's tail recomputed when a directive gives "
        "no budget (0: amortize, 1: forget; default %(default)s)",
    )
    p.add_argument(
        "--tool-format",
        choices=["hermes", "template"],
        default=None,
        help="a chat template without a tool block (SmolLM2's): hermes writes the tools and "
        "calls in the Hermes <tool_call> form, template refuses tools with a 400 "
        "(default: the model folder's leyline_tool_format, else hermes; docs/server.md)",
    )
    _add_limits_and_keys(p)


MIB = 1024 * 1024
# Flags only the embedded engine reads, with their defaults (``--engine sglang`` refuses any
# other value; ``--served-model-name`` is passed on to SGLang).
_EMBEDDED_ONLY = {
    "cache_tokens": 65536,
    "pin_ttl_s": DEFAULT_TTL_S,
    "no_packed_linears": False,
    "api_key": [],
    "api_key_file": [],
    "allowed_host": [],
    "max_body_bytes": 16 * MIB,
    "max_prompt_tokens": None,
    "max_tokens_cap": None,
    "queue_timeout_s": 300.0,
    "client_edits": "amortize",
    "repair_budget": DEFAULT_BUDGET,
    "concurrency": None,
    "tenant_cache_share": None,
    "shutdown_timeout_s": 30.0,
    "max_messages": 4096,
    "max_tools": 128,
    "max_schema_bytes": 256 * 1024,
    "max_key_requests": 128,
    "max_key_body_bytes": 1 * MIB,
    "max_key_refusals_per_s": 8.0,
    "tool_format": None,
}


def _add_limits_and_keys(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("tenants and limits (embedded engine)")
    g.add_argument(
        "--api-key",
        action="append",
        default=[],
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' on every route but /health (repeatable); "
        "each key is its own tenant: its own cache namespace and stats",
    )
    g.add_argument(
        "--api-key-file",
        action="append",
        default=[],
        metavar="PATH",
        help="keys, one per line: 'KEY' or 'KEY TENANT' ('#' comments). Keys that name the "
        "same TENANT share one cache namespace: the opt-in for a trusted deployment",
    )
    g.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        metavar="NAME",
        help="a Host header to answer besides localhost, 127.0.0.1 and [::1] (repeatable; "
        "NAME or NAME:PORT). On a loopback bind other Hosts get 400 (DNS rebinding); on "
        "another bind Hosts are checked only when this is given",
    )
    g.add_argument(
        "--max-body-bytes",
        type=int,
        default=_EMBEDDED_ONLY["max_body_bytes"],
        help="larger request bodies get 413 (default: 16 MiB)",
    )
    g.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=None,
        help="longer prompts get 400 (default: the model's context)",
    )
    g.add_argument(
        "--max-tokens-cap",
        type=int,
        default=None,
        help="a request's max_tokens above this gets 400 (default: no cap beyond the context)",
    )
    g.add_argument(
        "--queue-timeout-s",
        type=float,
        default=_EMBEDDED_ONLY["queue_timeout_s"],
        help="a request that waited longer for the engine gets 503 + Retry-After (default: 300)",
    )
    g.add_argument(
        "--concurrency",
        type=int,
        default=None,
        metavar="N",
        help="requests the engine runs at once, their decode steps batched; requests of one "
        "session (X-Leyline-Session) still run one after another (default: 16)",
    )
    g.add_argument(
        "--tenant-cache-share",
        type=float,
        default=None,
        metavar="F",
        help="each tenant may hold F * --cache-tokens rows (0 < F <= 1) before its own rows "
        "are the first evicted: a tenant over its share loses its LRU rows (then its pins) "
        "before anyone else loses any, so a tenant within its share keeps its rows under "
        "another's flood as long as the shares in use add up to at most 1 (F <= 1/tenants). "
        "Default: no shares, one LRU over all tenants",
    )
    g.add_argument(
        "--shutdown-timeout-s",
        type=float,
        default=_EMBEDDED_ONLY["shutdown_timeout_s"],
        metavar="S",
        help="on SIGTERM/SIGINT, let requests in flight run this long; then every generation "
        "stops: streams end with an error event, other requests get 503 (default: 30)",
    )
    g.add_argument(
        "--max-messages",
        type=int,
        default=_EMBEDDED_ONLY["max_messages"],
        metavar="N",
        help="a chat (or a message-form directive) with more messages gets 400 before it is "
        "rendered (default: 4096)",
    )
    g.add_argument(
        "--max-tools",
        type=int,
        default=_EMBEDDED_ONLY["max_tools"],
        metavar="N",
        help="a request with more tools gets 400 naming tools (default: 128)",
    )
    g.add_argument(
        "--max-schema-bytes",
        type=int,
        default=_EMBEDDED_ONLY["max_schema_bytes"],
        metavar="N",
        help="a request whose tool and response_format schemas pass this many bytes (compact "
        "JSON) gets 400 naming the schema that passed it, before any grammar work "
        "(default: 262144)",
    )
    g.add_argument(
        "--max-key-requests",
        type=int,
        default=_EMBEDDED_ONLY["max_key_requests"],
        metavar="N",
        help="an API key with this many requests in flight gets 429 + Retry-After for the "
        "next, before its body is read (default: 128)",
    )
    g.add_argument(
        "--max-key-body-bytes",
        type=int,
        default=_EMBEDDED_ONLY["max_key_body_bytes"],
        metavar="N",
        help="an API key whose request bodies in flight would pass this many bytes gets 429 + "
        "Retry-After, before the body is read; a key with nothing in flight is always "
        "admitted (default: 1 MiB)",
    )
    g.add_argument(
        "--max-key-refusals-per-s",
        type=float,
        default=_EMBEDDED_ONLY["max_key_refusals_per_s"],
        metavar="R",
        help="an API key whose requests are refused (4xx) more often than this per second "
        "(after a burst of 8 s worth) has its next requests wait, in arrival order, before "
        "their bodies are read, and reach the server at this rate; 429 + Retry-After after "
        "10 s of waiting (default: 8)",
    )


def register(sub: argparse._SubParsersAction) -> None:
    """Add this layer's verbs to the ``leyline`` parser."""
    sv = sub.add_parser("serve", help="OpenAI-compatible server with the Leyline routes")
    add_serve_arguments(sv)
    sv.set_defaults(func=_serve)


def _serve(args: argparse.Namespace) -> int:
    if args.engine == "sglang":
        _refuse_embedded_only(args)
        from leyline_agent.sglang_plugin.launch import serve
    else:
        from leyline_agent.server.main import serve
    return int(serve(args) or 0)


def _refuse_embedded_only(args: argparse.Namespace) -> None:
    """SGLang's own server does not read these: never ignore a key or a limit silently."""
    from leyline_agent.errors import LeylineError

    given = [k for k, default in _EMBEDDED_ONLY.items() if getattr(args, k, default) != default]
    if given:
        flags = ", ".join("--" + k.replace("_", "-") for k in given)
        raise LeylineError(
            f"{flags}: only the embedded engine has this; SGLang's server would ignore it"
        )
