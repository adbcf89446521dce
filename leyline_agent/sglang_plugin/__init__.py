"""Leyline as an SGLang 0.5.23 plugin: AMORTIZE splices inside SGLang's scheduler.

Three levels, as SGLang has them: the ``RadixCache`` (token ids -> int64 slot indices per
node), the ``TokenToKVPoolAllocator`` (hands out and takes back slots), the KV pool
(``MLATokenToKVPool`` rows ``[latent | k_pe]``, or ``MHATokenToKVPool`` keys/values).

- ``treeview``: read-only prefix lookups (``match_prefix`` splits nodes; validation must not).
- ``radix_backend``: ``--radix-cache-backend leyline``, SGLang's plain ``RadixCache``.
- ``plan``: pure, from two lookups and a directive to a ``TreeSplicePlan`` of slot indices.
- ``kv_write``: the bytes (``leyline_agent.kernels.rotate_band``, out of place).
- ``routing``: which radix namespace (SGLang's ``extra_key``) a request reads and writes:
  spliced rows live in their session's tree, the plain tree holds exact rows only.
- ``splice``: lock, allocate, write, insert ``T'`` into the session's tree, unlock (no
  leaks, no double frees).
- ``forget``: before a FORGET's prefill, drop the session's rows of ``T'`` from the span on.
- ``scheduler_hook``: ``Scheduler.leyline_splice(**flat_scalars)`` (and ``leyline_lookup``,
  ``leyline_check``, ``leyline_forget``) for ``collective_rpc``; answers ride back in the
  reply's message.
- ``batch``: pure, from a ``directives.pipeline.Plan`` to the ``DirectiveCalls`` that
  execute it, and the answer.
- ``executor``: ``SGLangBackend``, the ``directives.service.DirectiveBackend`` over a
  transport: ``leyline_lookup``, every check, then the prefill -> splice loop; flush.
- ``client``: ``SGLangRuntime`` (the ``Runtime`` protocol over an embedded ``sglang.Engine``),
  and the ``DirectiveService`` of a served model (``directive_service``).
- ``http_route``: the service's routes on SGLang's own HTTP server.
- ``launch``: ``leyline serve --engine sglang``.

``register`` is the ``sglang.srt.plugins`` entry point; SGLang's ``load_plugins()`` calls it
with no arguments in every process (main, schedulers, detokenizer) before the engine
starts, then applies the registered hooks. Importing this package imports neither torch
nor SGLang. The plugin uses the contracts, ``directives`` and ``kernels``; it never imports
the embedded engine nor the server.
"""

from __future__ import annotations

import multiprocessing

from leyline_agent.sglang_plugin.radix_backend import RADIX_CACHE_BACKEND

__all__ = ["RADIX_CACHE_BACKEND", "register"]


def register() -> None:
    """Entry point of the ``sglang.srt.plugins`` group (see the module docstring)."""
    from sglang.srt.mem_cache.registry import (
        get_radix_cache_factory,
        register_radix_cache_backend,
    )
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from leyline_agent.sglang_plugin.radix_backend import radix_cache_factory
    from leyline_agent.sglang_plugin.routing import (
        before_generate_request,
        before_scheduler_request,
    )
    from leyline_agent.sglang_plugin.scheduler_hook import (
        after_scheduler_init,
        around_rpc_request,
    )

    # --radix-cache-backend leyline: the plain RadixCache the splice works on (SGLang's
    # default chain builds a UnifiedRadixCache). Registered in every process: the main
    # process validates the flag, the schedulers build the tree.
    if get_radix_cache_factory(RADIX_CACHE_BACKEND) is None:
        register_radix_cache_backend(RADIX_CACHE_BACKEND, radix_cache_factory)
    HookRegistry.register(
        "sglang.srt.managers.scheduler.Scheduler.__init__", after_scheduler_init, HookType.AFTER
    )
    # a Leyline RPC's answer (leyline_lookup's cached length) rides back in its reply
    HookRegistry.register(
        "sglang.srt.managers.scheduler.Scheduler.handle_rpc_request",
        around_rpc_request,
        HookType.AROUND,
    )
    # every request is routed to its session's tree or the plain one (routing.py)
    HookRegistry.register(
        "sglang.srt.managers.scheduler.Scheduler.handle_generate_request",
        before_scheduler_request,
        HookType.BEFORE,
    )
    if multiprocessing.parent_process() is None:  # HTTP server + tokenizer manager live here
        from leyline_agent.sglang_plugin.http_route import before_http_server

        HookRegistry.register(
            "sglang.srt.entrypoints.http_server._setup_and_run_http_server",
            before_http_server,
            HookType.BEFORE,
        )
        HookRegistry.register(  # X-Leyline-Session -> the request's extra key
            "sglang.srt.managers.tokenizer_manager.TokenizerManager.generate_request",
            before_generate_request,
            HookType.BEFORE,
        )
