"""The reliability harness: a live ``leyline serve`` per module, watched while hostile requests run.

Every module of this folder gets one real ``leyline serve`` process (the command line, as a
deployment runs it) on the tiny seeded model of the root conftest's ``model_dir`` (``ARCH``),
with a key file of two tenants, each with two keys (``reliability.KEYS``: import the key
names from there): ``mallory`` sends the hostile
requests, ``alice`` is the bystander. A module adds its own flags in ``SERVER_ARGS``.

``hostile(send)`` is the one assertion of this folder: while ``/health`` is polled and alice
streams a chat (``leyline_agent.testing.reliability.Watch``), it sends one request and checks
that ``/health`` answered within ``HEALTH_S`` throughout, alice's worst inter-token gap stayed
under ``GAP_S``, and the request ended within ``HOSTILE_S`` with a 4xx whose ``error.param``
starts with ``field`` (or, with ``ok=True``, a 200). It returns the ``TimedAnswer``.

Fixtures: ``live`` (the ``ServerProcess``), ``http`` (an ``httpx.Client`` on it, no key),
``as_key(key)`` (headers), ``served_name`` (the model id), ``hostile``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from leyline_agent.testing.reliability import (
    ALICE,
    MALLORY,
    TimedAnswer,
    Watch,
    bounded_answer,
    key_file_text,
)
from leyline_agent.testing.server import ServerProcess, serve_in_process

HEALTH_S = 0.5
GAP_S = 0.5
HOSTILE_S = 10.0


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test of this folder bounds latency (``HEALTH_S``, ``GAP_S``): marked ``timing``,
    so ``make test`` runs them with nothing else of the suite beside them."""
    here = Path(__file__).parent
    for item in items:
        if item.path.is_relative_to(here):
            item.add_marker(pytest.mark.timing)


@pytest.fixture(scope="module")
def as_key() -> Callable[[str], dict[str, str]]:
    return lambda key: {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def key_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys.txt"
    path.write_text(key_file_text())
    return path


@pytest.fixture(scope="module")
def live(request, model_dir, key_file, tmp_path_factory):
    args = ("--api-key-file", str(key_file), *getattr(request.module, "SERVER_ARGS", ()))
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with serve_in_process(model_dir, *args, log_path=log) as srv:
        yield srv


@pytest.fixture(scope="module")
def served_name(model_dir) -> str:
    return model_dir.name


@pytest.fixture(scope="module")
def http(live: ServerProcess):
    with httpx.Client(base_url=live.url, timeout=HOSTILE_S + 50) as c:
        yield c


def _server_log(live: ServerProcess) -> str:
    if live.log_path is None or not live.log_path.exists():
        return ""
    return live.log_path.read_text(errors="replace")[-3000:]


@pytest.fixture
def hostile(live: ServerProcess, served_name: str) -> Callable[..., TimedAnswer]:
    def check(
        send: Callable[[], httpx.Response], *, field: str | None = None, ok: bool = False
    ) -> TimedAnswer:
        with Watch(live.url, key=ALICE, model=served_name) as watch:
            answer = bounded_answer(send)
        report = watch.report()
        problems = report.problems(health_s=HEALTH_S, gap_s=GAP_S)
        if answer.error is not None:
            problems.append(f"the hostile request got no answer: {answer.error}")
        elif answer.elapsed_s >= HOSTILE_S:
            problems.append(
                f"the hostile request took {answer.elapsed_s:.1f}s (bound {HOSTILE_S}s)"
            )
        status = answer.status
        if status is not None:
            body = answer.response.text[:500]  # type: ignore[union-attr]
            if ok and status == 200:
                pass
            elif not 400 <= status < 500:
                problems.append(f"the hostile request got HTTP {status}, not a 4xx: {body}")
            elif field is not None and not (answer.error_field or "").startswith(field):
                problems.append(f"the 4xx names {answer.error_field!r}, not {field!r}: {body}")
        if live.process.poll() is not None:
            problems.append(f"the server exited ({live.process.returncode}):\n{_server_log(live)}")
        assert not problems, "\n".join(problems) + f"\n{report}"
        return answer

    return check


@pytest.fixture
def post(http: httpx.Client, as_key) -> Callable[..., httpx.Response]:
    """``post(path, body, key=MALLORY)``: one request as ``key``, the harness's timeout."""

    def send(path: str, body: object, key: str = MALLORY) -> httpx.Response:
        return http.post(path, json=body, headers=as_key(key))

    return send
