"""Seeded checkpoints built once per machine with the model factory (``modelgen``).

Tests, benchmarks and the demo need the same few random-weight models; building one takes
seconds (the tokenizer longer), so they are cached. ``model_dir(arch, size, seed)`` /
``tiny_model_dir(arch)`` return a checkpoint directory under a cache folder
(``$LEYLINE_TEST_MODELS`` or ``<tmp>/leyline-test-models``), keyed by the arch, size, seed
and a fingerprint of the model factory's sources and of the tokenizer's training text (it
includes debug-gym's tasks where debug-gym is installed: the vLLM venv has no debug-gym, so
it trains another tokenizer and keys its checkpoints apart), so a change rebuilds them.
Builds are atomic (temp dir + rename) and serialized with a lock file, so parallel pytest
processes don't race. The tokenizer is trained once and shared by every arch.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import tempfile
from contextlib import contextmanager
from functools import cache
from pathlib import Path

__all__ = ["cache_root", "cache_lock", "tiny_model_dir", "model_dir"]

_FACTORY_FILES = ("modelgen.py", "toy_tokenizer.py")


def cache_root() -> Path:
    env = os.environ.get("LEYLINE_TEST_MODELS")
    root = Path(env) if env else Path(tempfile.gettempdir()) / "leyline-test-models"
    root.mkdir(parents=True, exist_ok=True)
    return root


@cache
def _fingerprint() -> str:
    from leyline_agent.engine.checkpoints.toy_tokenizer import training_text_key

    h = hashlib.sha256()
    for name in _FACTORY_FILES:
        h.update((Path(__file__).parent / name).read_bytes())
    h.update(training_text_key().encode())
    return h.hexdigest()[:12]


@contextmanager
def cache_lock(root: Path):
    """Serialize builds in the cache folder across processes (an exclusive flock)."""
    with open(root / ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@cache
def _tokenizer_dir() -> Path:
    root = cache_root()
    out = root / f"tokenizer-{_fingerprint()}"
    with cache_lock(root):
        if not (out / "tokenizer.json").is_file():
            from leyline_agent.engine.checkpoints.toy_tokenizer import train_tokenizer

            tmp = Path(tempfile.mkdtemp(prefix=".tok.", dir=root))
            train_tokenizer().save_pretrained(tmp)
            tmp.rename(out)
    return out


@cache
def model_dir(arch: str, size: str = "tiny", seed: int = 0) -> Path:
    """A checkpoint of (arch, size, seed), built on first use and reused afterwards."""
    root = cache_root()
    out = root / f"{arch}-{size}-s{seed}-{_fingerprint()}"
    if (out / "config.json").is_file():
        return out
    tok_dir = _tokenizer_dir()
    with cache_lock(root):
        if not (out / "config.json").is_file():
            from transformers import AutoTokenizer

            from leyline_agent.engine.checkpoints.modelgen import make_model

            make_model(arch, size, out, seed=seed, tokenizer=AutoTokenizer.from_pretrained(tok_dir))
    return out


def tiny_model_dir(arch: str, seed: int = 0) -> Path:
    return model_dir(arch, "tiny", seed)
