"""``leyline serve --engine sglang``: what it asks SGLang for, and its one-line refusal here.

On a machine without CUDA (or with SGLang installed ``--no-deps``, as the test set-up
does) the command must print one line naming the problem and exit non-zero; on a GPU box
it starts SGLang's server (not exercised here).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from leyline_agent.errors import RuntimeUnavailableError
from leyline_agent.sglang_plugin import RADIX_CACHE_BACKEND
from leyline_agent.sglang_plugin.launch import require_full_sglang, server_kwargs


def _args(**over) -> argparse.Namespace:
    base = dict(
        model="/models/x", host="127.0.0.1", port=30001, dtype="bfloat16", device="auto",
        cache_tokens=65536, no_prefix_cache=False, engine="sglang",
    )  # fmt: skip
    return argparse.Namespace(**{**base, **over})


def test_sglang_server_kwargs() -> None:
    from sglang.srt.server_args import ServerArgs

    kw = server_kwargs(_args())
    sa = ServerArgs(**kw)  # SGLang's own constructor rejects unknown keywords
    assert sa.page_size == 1 and sa.radix_cache_backend == RADIX_CACHE_BACKEND
    assert (sa.model_path, sa.port, sa.dtype) == ("/models/x", 30001, "bfloat16")
    assert sa.served_model_name == "x"  # the folder name, as the embedded engine serves it
    assert ServerArgs(**server_kwargs(_args(served_model_name="m1"))).served_model_name == "m1"
    with pytest.raises(RuntimeUnavailableError, match="--no-prefix-cache"):
        server_kwargs(_args(no_prefix_cache=True))
    with pytest.raises(RuntimeUnavailableError, match="--device cpu"):
        server_kwargs(_args(device="cpu"))


def test_sglang_serve_refuses_in_one_line_without_gpu(tmp_path) -> None:
    if torch.cuda.is_available():  # pragma: no cover - GPU boxes start the server instead
        pytest.skip("this machine has CUDA: serve would start SGLang")
    with pytest.raises(RuntimeUnavailableError, match="CUDA"):
        require_full_sglang()
    # as a user runs it (a subprocess: the CLI configures logging for its whole process)
    script = Path(sys.executable).parent / "leyline"
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "leyline_agent.cli"]
    proc = subprocess.run(
        [*cmd, "serve", "--engine", "sglang", "--model", str(tmp_path)],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    err = proc.stderr.strip()
    assert proc.returncode != 0 and proc.stdout == ""
    assert len(err.splitlines()) == 1, err
    assert "CUDA" in err and "--engine embedded" in err


@pytest.mark.parametrize(
    "flags",
    [
        ["--cache-tokens", "1024"],
        ["--pin-ttl-s", "0"],
        ["--no-packed-linears"],
        ["--api-key", "k"],
        ["--max-messages", "8"],
    ],
)
def test_flags_only_the_embedded_engine_reads_are_refused_by_name(flags) -> None:
    """SGLang's server would not read them: ``--engine sglang`` names each one and stops,
    never a silent default; the same flags are accepted by the embedded engine."""
    from leyline_agent.cli import build_parser
    from leyline_agent.errors import LeylineError
    from leyline_agent.server.cli import _refuse_embedded_only

    base = ["serve", "--model", "/models/x"]
    with pytest.raises(LeylineError, match=flags[0]):
        _refuse_embedded_only(build_parser().parse_args([*base, "--engine", "sglang", *flags]))
    _refuse_embedded_only(build_parser().parse_args([*base, "--engine", "sglang"]))
    _refuse_embedded_only(build_parser().parse_args([*base, "--served-model-name", "m"]))
