"""``leyline serve --engine sglang --model PATH``: SGLang's own server with the plugin.

It starts SGLang 0.5.23's HTTP server (``launch_server``: the engine's scheduler and
detokenizer processes plus the OpenAI-compatible routes) with ``--page-size 1`` and
``--radix-cache-backend leyline``; the plugin, loaded by SGLang's ``load_plugins()`` in
every process, adds ``Scheduler.leyline_splice`` and ``POST /leyline/v1/directives``.
In Python, ``client.SGLangRuntime.launch(path)`` starts an embedded ``sglang.Engine``.

Without CUDA, or with SGLang installed ``--no-deps`` (no ``sgl_kernel``), it raises
``RuntimeUnavailableError``: the CLI prints that one line and exits 2.
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path
from typing import Any

from leyline_agent.errors import RuntimeUnavailableError

__all__ = ["require_full_sglang", "serve", "server_kwargs"]


def require_full_sglang() -> None:
    """Raise ``RuntimeUnavailableError`` (one line) unless SGLang can run a model here."""
    if importlib.util.find_spec("sglang") is None:
        raise RuntimeUnavailableError(
            "--engine sglang: SGLang is not installed (pip install 'leyline-agent[sglang]' "
            "on a CUDA machine), or use --engine embedded"
        )
    import torch

    if not torch.cuda.is_available():
        raise RuntimeUnavailableError(
            "--engine sglang needs a CUDA GPU and none is visible here; use --engine embedded"
        )
    if importlib.util.find_spec("sgl_kernel") is None:
        raise RuntimeUnavailableError(
            "--engine sglang: SGLang is installed without its CUDA kernels (sgl_kernel); "
            "install the full sglang==0.5.23, not the --no-deps test set-up"
        )


def server_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """``ServerArgs`` keywords for the ``leyline serve`` arguments (pure)."""
    if getattr(args, "no_prefix_cache", False):
        raise RuntimeUnavailableError(
            "--no-prefix-cache: the SGLang plugin splices the radix cache; drop the flag"
        )
    if getattr(args, "device", "auto") == "cpu":
        raise RuntimeUnavailableError("--device cpu: use --engine embedded on CPU")
    from leyline_agent.sglang_plugin.radix_backend import RADIX_CACHE_BACKEND

    return {
        "model_path": str(args.model),
        "host": args.host,
        "port": int(args.port),
        "dtype": {"float32": "float32", "bfloat16": "bfloat16"}.get(args.dtype, "auto"),
        # the id /v1/models lists: the folder name unless given, as on the embedded engine
        "served_model_name": getattr(args, "served_model_name", None) or Path(args.model).name,
        "page_size": 1,
        "radix_cache_backend": RADIX_CACHE_BACKEND,
    }


def serve(args: argparse.Namespace) -> int:
    kwargs = server_kwargs(args)
    require_full_sglang()
    from sglang.srt.entrypoints.http_server import launch_server
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import ServerArgs

    load_plugins()  # this process: the radix-cache backend and the HTTP route
    launch_server(ServerArgs(**kwargs))
    return 0
