"""Fixtures shared by the test modules: a tiny model served over real HTTP (in a thread).

A module that uses them names its model's architecture in ``ARCH`` (default
``deepseek_v2``); every fixture is module-scoped, so each module gets its own server. A
module's own fixture of the same name takes precedence.

``model_dir``: the seeded tiny model; ``tok``: its tokenizer; ``stop_ids``: the chat
format's stop tokens (``leyline_agent.families``); ``server``: an ``Engine`` on it behind
``serve_in_thread`` (with a module's ``SERVER_KWARGS``, ``create_app``'s options); ``http``:
an ``httpx`` client on it; ``client``: the real ``openai`` client on that server (no retries);
``name``: the served model name; ``ref_model``: transformers' own model (fp32, eval) of a
module's ``arch`` fixture, the ground truth. A folder's own fixtures live in its conftest
(``tests/kernels/conftest.py``: ``threads``).

(Run with ``--import-mode=importlib``: there is no ``tests`` package, and nothing imports
this module; debug-gym installs a top-level package named ``tests``.)
"""

from __future__ import annotations

import openai
import pytest

from leyline_agent.engine.checkpoints.store import tiny_model_dir
from leyline_agent.families import CHATML_HERMES
from leyline_agent.reference.hf_reference import hf_model
from leyline_agent.testing.server import serve_in_thread


@pytest.fixture(scope="module")
def ref_model(arch):
    return hf_model(tiny_model_dir(arch))


@pytest.fixture(scope="module")
def model_dir(request):
    return tiny_model_dir(getattr(request.module, "ARCH", "deepseek_v2"))


@pytest.fixture(scope="module")
def tok(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def stop_ids(tok):
    return tok.convert_tokens_to_ids(list(CHATML_HERMES.stop_tokens))


@pytest.fixture(scope="module")
def server(request, model_dir):
    from leyline_agent.engine.engine import Engine

    kwargs = getattr(request.module, "SERVER_KWARGS", {})  # create_app's options, per module
    with serve_in_thread(Engine.from_pretrained(model_dir), **kwargs) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    import httpx

    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def name(model_dir):
    return model_dir.name
