"""Module-scoped pytest fixtures for a tiny model served over real HTTP (in a thread).

A test module binds them at its top level, where pytest collects them::

    model_dir, tok, stop_ids, server, client, name = served_model_fixtures("deepseek_v2")

``model_dir``: the seeded tiny model (``tiny_model_dir``); ``tok``: its tokenizer;
``stop_ids``: the chat template's stop tokens; ``server``: an ``Engine`` on it behind
``serve_in_thread``; ``client``: the real ``openai`` client on that server (no retries);
``name``: the served model name. Each module that calls this gets its own server.
"""

from __future__ import annotations

import random
from typing import Any

from leyline_agent.engine.checkpoints.store import tiny_model_dir
from leyline_agent.testing.server import serve_in_thread

__all__ = ["random_ids", "served_model_fixtures"]


def random_ids(seed: int, n: int) -> list[int]:
    """``n`` seeded token ids inside the tiny models' vocabulary, clear of the first ids."""
    rng = random.Random(seed)
    return [rng.randrange(3, 5990) for _ in range(n)]


def served_model_fixtures(arch: str) -> tuple[Any, ...]:
    """(model_dir, tok, stop_ids, server, client, name) fixtures for a tiny ``arch`` model."""
    import openai
    import pytest

    @pytest.fixture(scope="module")
    def model_dir():
        return tiny_model_dir(arch)

    @pytest.fixture(scope="module")
    def tok(model_dir):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model_dir)

    @pytest.fixture(scope="module")
    def stop_ids(tok):
        return tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])

    @pytest.fixture(scope="module")
    def server(model_dir):
        from leyline_agent.engine.engine import Engine

        with serve_in_thread(Engine.from_pretrained(model_dir)) as srv:
            yield srv

    @pytest.fixture(scope="module")
    def client(server):
        return openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0)

    @pytest.fixture(scope="module")
    def name(model_dir):
        return model_dir.name

    return model_dir, tok, stop_ids, server, client, name
