"""``--radix-cache-backend leyline``: the plain ``RadixCache`` the splice works on.

SGLang 0.5.23's default chain builds a ``UnifiedRadixCache``; the splice needs the plain
tree (page size 1, token-id keys). ``register`` (the plugin entry point) registers
``radix_cache_factory`` under ``RADIX_CACHE_BACKEND`` in every process: the main process
validates the flag, the schedulers build the tree. SGLang is imported when it is called.
"""

from __future__ import annotations

__all__ = ["RADIX_CACHE_BACKEND", "radix_cache_factory"]

RADIX_CACHE_BACKEND = "leyline"


def radix_cache_factory(ctx):  # noqa: ANN001, ANN202 (sglang's TreeCacheBuildContext)
    from sglang.srt.mem_cache.radix_cache import RadixCache

    from leyline_agent.errors import RuntimeUnavailableError

    if ctx.is_hybrid_swa or ctx.is_hybrid_ssm or ctx.is_dsa:
        raise RuntimeUnavailableError(
            "--radix-cache-backend leyline: hybrid SWA/SSM and DSA models are not supported"
        )
    if ctx.enable_hierarchical_cache:
        raise RuntimeUnavailableError(
            "--radix-cache-backend leyline: --enable-hierarchical-cache is not supported"
        )
    return RadixCache(ctx.params)
