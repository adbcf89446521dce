"""Tenants and isolation over real HTTP: API keys, per-tenant caches and stats, Host allowlist.

Expected values are computed here, independently of the server: which tenant a key is
(``sha256`` of the key, by hand), how many prompt tokens a repeat may find cached (the
prompt's length less its last token, which the engine always recomputes), and which
``Host`` headers a loopback server may answer.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys

import httpx
import pytest

from leyline_agent.testing.server import serve_in_process, serve_in_thread
from leyline_agent.testing.token_ids import random_ids

pytestmark = pytest.mark.slow

KEYS = {"alpha-key": None, "beta-key": None, "team-key-1": "team", "team-key-2": "team"}


@pytest.fixture(scope="module")
def keyed(model_dir):
    from leyline_agent.engine.engine import Engine

    engine = Engine.from_pretrained(model_dir)
    with serve_in_thread(engine, api_keys=list(KEYS.items()), allowed_hosts=[]) as srv:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            yield c, model_dir.name


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _complete(c: httpx.Client, name: str, key: str, ids: list[int]) -> dict:
    body = {"model": name, "prompt": ids, "max_tokens": 1, "temperature": 0}
    r = c.post("/v1/completions", json=body, headers=_auth(key))
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def test_every_route_but_health_needs_a_valid_key(keyed):
    c, name = keyed
    routes = [
        ("GET", "/v1/models", None),
        ("POST", "/v1/completions", {"model": name, "prompt": [5, 6], "max_tokens": 1}),
        ("POST", "/v1/chat/completions", {"model": name, "messages": [{"role": "user", "content": "x"}]}),
        ("POST", "/leyline/v1/directives", {"tokens": [5, 6], "directives": [{"start": 0, "end": 1}]}),
        ("GET", "/leyline/v1/stats", None),
        ("GET", "/nowhere", None),
    ]  # fmt: skip
    bad_headers = [
        {},
        _auth("wrong-key"),
        _auth("alpha-ke"),  # a prefix of a real key
        {"Authorization": "Bearer"},
        {"Authorization": "alpha-key"},  # no scheme
        {"Authorization": "Basic alpha-key"},
    ]
    for method, path, body in routes:
        for headers in bad_headers:
            r = c.request(method, path, json=body, headers=headers)
            assert r.status_code == 401, (path, headers, r.text)
            assert r.json()["error"]["leyline_type"] == "AuthenticationError"
            assert r.json()["error"]["type"] == "authentication_error"
            assert r.json()["error"]["field"] == "authorization"
            assert r.headers["www-authenticate"] == "Bearer"
    assert c.get("/health").status_code == 200
    for key in KEYS:
        assert c.get("/v1/models", headers=_auth(key)).status_code == 200
        assert c.get("/v1/models", headers={"Authorization": f"bearer  {key}"}).status_code == 200


def test_two_tenants_caches_are_independent_and_a_shared_tenant_shares(keyed):
    c, name = keyed
    P = random_ids(101, 40)
    assert _complete(c, name, "alpha-key", P)["prompt_tokens_details"]["cached_tokens"] == 0
    assert _complete(c, name, "alpha-key", P)["prompt_tokens_details"]["cached_tokens"] == 39
    # beta sends the very same prompt: nothing of alpha's is visible to it
    assert _complete(c, name, "beta-key", P)["prompt_tokens_details"]["cached_tokens"] == 0
    assert _complete(c, name, "beta-key", P)["prompt_tokens_details"]["cached_tokens"] == 39
    # a prefix of alpha's prompt: still nothing for a third tenant
    Q = P[:30]
    assert _complete(c, name, "team-key-1", Q)["prompt_tokens_details"]["cached_tokens"] == 0
    # two keys of one tenant share its namespace
    assert _complete(c, name, "team-key-2", Q)["prompt_tokens_details"]["cached_tokens"] == 29

    stats = {k: c.get("/leyline/v1/stats", headers=_auth(k)).json() for k in KEYS}
    want_alpha = "key-" + hashlib.sha256(b"alpha-key").hexdigest()[:12]
    assert stats["alpha-key"]["tenant"] == want_alpha
    assert stats["alpha-key"]["requests"] == 2 and stats["alpha-key"]["cached_tokens"] == 39
    assert stats["beta-key"]["requests"] == 2 and stats["beta-key"]["cached_tokens"] == 39
    assert stats["team-key-1"] == stats["team-key-2"]
    assert stats["team-key-1"]["tenant"] == "team" and stats["team-key-1"]["requests"] == 2
    assert stats["team-key-1"]["cached_tokens"] == 29


def test_host_allowlist_answers_loopback_names_and_the_names_given(model_dir):
    from leyline_agent.engine.engine import Engine

    engine = Engine.from_pretrained(model_dir)
    with serve_in_thread(engine, allowed_hosts=["agents.internal", "box.lan:8443"]) as srv:
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            ok = [
                "localhost", "LOCALHOST:30000", "127.0.0.1", f"127.0.0.1:{srv.port}", "[::1]",
                "[::1]:80", "localhost.", "agents.internal", "agents.internal:9", "box.lan:8443",
            ]  # fmt: skip
            bad = [
                "evil.example", "evil.example:30000", "localhost.evil.example",
                "127.0.0.1.nip.io", "agents.internal.evil", "box.lan", "box.lan:8444",
                "[::2]", "0.0.0.0", "",
            ]  # fmt: skip
            for host in ok:
                assert c.get("/health", headers={"Host": host}).status_code == 200, host
            for host in bad:
                r = c.get("/v1/models", headers={"Host": host})
                assert r.status_code == 400, (host, r.text)
                assert r.json()["error"] == {
                    "type": "invalid_request_error",
                    "leyline_type": "HostNotAllowedError",
                    "message": r.json()["error"]["message"],
                    "param": "host",
                    "code": "host_not_allowed",
                    "field": "host",
                }
                assert c.get("/health", headers={"Host": host}).status_code == 400


def test_key_file_parsing_and_default_tenants(tmp_path):
    from leyline_agent.server.tenants import ApiKeys, key_tenant, read_key_file

    f = tmp_path / "keys"
    f.write_text("# team keys\nk1 team\n\n  k2   team  \nsolo\n")
    assert read_key_file(f) == [("k1", "team"), ("k2", "team"), ("solo", None)]
    keys = ApiKeys.build(read_key_file(f))
    assert keys.tenant(b"k1") == keys.tenant(b"k2") == "team"
    assert keys.tenant(b"solo") == "key-" + hashlib.sha256(b"solo").hexdigest()[:12]
    assert key_tenant("solo") == keys.tenant(b"solo")
    assert keys.tenant(b"k3") is None and keys.tenant(b"") is None
    f.write_text("k1 team extra\n")
    with pytest.raises(ValueError, match="keys:1"):
        read_key_file(f)
    with pytest.raises(ValueError, match="twice"):
        ApiKeys.build([("k1", "a"), ("k1", "b")])


def test_leyline_serve_with_keys_and_a_key_file(model_dir, tmp_path):
    """The real command line: keys from flags and a file, Host check on (loopback bind)."""
    key_file = tmp_path / "keys"
    key_file.write_text("shared-1 ops\nshared-2 ops\n")
    with serve_in_process(
        model_dir, "--device", "cpu", "--api-key", "solo-key", "--api-key-file", str(key_file)
    ) as srv:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            assert c.get("/health").status_code == 200
            assert c.get("/v1/models").status_code == 401
            assert c.get("/v1/models", headers={"Host": "evil.example"}).status_code == 400
            P = random_ids(102, 24)
            name = model_dir.name
            assert _complete(c, name, "shared-1", P)["prompt_tokens_details"]["cached_tokens"] == 0
            assert _complete(c, name, "shared-2", P)["prompt_tokens_details"]["cached_tokens"] == 23
            assert _complete(c, name, "solo-key", P)["prompt_tokens_details"]["cached_tokens"] == 0
            tenant = c.get("/leyline/v1/stats", headers=_auth("shared-2")).json()["tenant"]
            assert tenant == "ops"


def test_serve_help_documents_the_flags():
    out = subprocess.run(
        [sys.executable, "-m", "leyline_agent.cli", "serve", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for flag in (
        "--api-key",
        "--api-key-file",
        "--allowed-host",
        "--max-body-bytes",
        "--max-prompt-tokens",
        "--max-tokens-cap",
        "--queue-timeout-s",
    ):
        assert flag in out, flag
    assert "share one cache namespace" in " ".join(out.split())


def test_sglang_engine_refuses_keys_and_limits_it_would_ignore(capsys):
    from leyline_agent.cli import main

    argv = ["serve", "--model", "/nonexistent", "--engine", "sglang", "--api-key", "k"]
    assert main(argv) == 2
    assert "--api-key" in capsys.readouterr().err


def test_the_anthropic_sdk_authenticates_with_api_key_only(keyed):
    """The real ``anthropic`` SDK with ``api_key=`` only (the pinned version sends it as
    ``Authorization: Bearer``), and with the key as ``x-api-key`` alone (Anthropic's own
    header, what its docs and other clients send): the Messages routes take either as that
    key's tenant; a wrong key is a 401; other routes still want ``Authorization``."""
    import anthropic
    import httpx2  # the SDK's own HTTP client package

    c, name = keyed
    url = str(c.base_url).rstrip("/")
    msgs = [{"role": "user", "content": "Name a colour."}]
    for auth in ({"api_key": "beta-key"}, {"default_headers": {"X-Api-Key": "beta-key"}}):
        sent: list = []  # the requests as the SDK sent them
        sdk = anthropic.Anthropic(
            base_url=url, max_retries=0, timeout=60,
            http_client=httpx2.Client(event_hooks={"request": [sent.append]}), **auth,
        )  # fmt: skip
        before = c.get("/leyline/v1/stats", headers=_auth("beta-key")).json()["requests"]
        m = sdk.messages.create(model=name, max_tokens=2, messages=msgs)
        assert m.type == "message" and m.usage.output_tokens <= 2
        after = c.get("/leyline/v1/stats", headers=_auth("beta-key")).json()["requests"]
        assert after == before + 1  # counted under beta's tenant
        assert sdk.messages.count_tokens(model=name, messages=msgs).input_tokens > 0
        keys = {(r.headers.get("authorization"), r.headers.get("x-api-key")) for r in sent}
        assert keys == {("Bearer beta-key", None) if "api_key" in auth else (None, "beta-key")}
    for auth in ({"api_key": "wrong-key"}, {"default_headers": {"X-Api-Key": "wrong-key"}}):
        wrong = anthropic.Anthropic(base_url=url, max_retries=0, timeout=60, **auth)
        with pytest.raises(anthropic.AuthenticationError):
            wrong.messages.create(model=name, max_tokens=1, messages=msgs)
        with pytest.raises(anthropic.AuthenticationError):
            wrong.messages.count_tokens(model=name, messages=msgs)
    assert c.get("/v1/models", headers={"x-api-key": "beta-key"}).status_code == 401
