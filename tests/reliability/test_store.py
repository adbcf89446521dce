"""The Responses store, bounded: over HTTP on a live ``leyline serve`` watched by the harness,
and its byte budget and TTL on the store itself (sizes computed here with ``json``).

- ``metadata`` as OpenAI caps it (16 pairs, keys of 64 characters, values of 512): at the caps
  it is stored and echoed; one past any of them, a 10 MB value, 5,000 keys, a 1 MB unknown key
  in ``text`` and a 10 KB ``user`` are each a 400 naming the field; 16 MiB of metadata is
  refused (the body limit, or the metadata cap, whichever reads it first);
- a response that would store more than an entry may hold is a 400 naming ``store``;
- ``/leyline/v1/stats`` counts the tenant's stored responses and bytes; ``/leyline/v1/flush``
  drops them (``dropped_responses``) and they read as unknown afterwards; the other tenant's
  are untouched;
- 4 responses of a 250 KB ``input`` (a prompt within the context): counted, held in the
  server's store files (their sizes add up to the counted bytes), the server's RSS grows by
  less than the store's per-tenant budget (256 MiB), and after flush the files are gone and
  the RSS is within 64 MB of where it was before them (``leyline bench store-budget`` runs
  1 MB inputs);
- ``ResponseStore``: entries past the tenant's byte budget go least recently used first, the
  bytes it counts are the entries' compact JSON, and an entry past its TTL reads as unknown;
  entries live in files of the store's directory, which flush and close empty;
- large bodies: a 12 MB body of 6 million numbers (``json.loads`` holds the GIL about half a
  second on it) is refused with a 400 naming ``body`` while ``/health`` keeps answering (on
  routes FastAPI parses and on one that parses its own body); a body of 60,000 ``metadata``
  pairs (parsed by the yielding scanner) is served.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from leyline_agent.server.responses_store import (
    SPILL_PREFIX,
    ResponseStore,
    StoredResponse,
    StoreLimits,
)
from leyline_agent.testing.reliability import ALICE, MALLORY, MALLORY_2, long_input

RESPONSES = "/v1/responses"
LARGE_RESPONSES = 4
INPUT_BYTES = 250_000  # 6,500 tokens: its first prefill stays short on a loaded machine


def _body(name: str, **extra) -> dict:
    return {"model": name, "input": "Hi.", "max_output_tokens": 2, "temperature": 0, **extra}


def test_metadata_at_openais_caps_is_stored_and_echoed(post, http, as_key, served_name):
    metadata = {f"{k:02d}" + "k" * 62: "v" * 512 for k in range(16)}
    r = post(RESPONSES, _body(served_name, metadata=metadata))
    assert r.status_code == 200, r.text
    got = http.get(f"{RESPONSES}/{r.json()['id']}", headers=as_key(MALLORY))
    assert got.status_code == 200 and got.json()["metadata"] == metadata


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"metadata": {f"k{k}": "v" for k in range(17)}}, "metadata"),
        ({"metadata": {"k" * 65: "v"}}, "metadata"),
        ({"metadata": {"k": "v" * 513}}, "metadata.k"),
        ({"metadata": {"big": "v" * 10_000_000}}, "metadata.big"),
        ({"metadata": {f"k{k}": "v" for k in range(5000)}}, "metadata"),
        ({"text": {"format": {"type": "text"}, "x" * 16: "y" * 1_000_000}}, "text.xxxx"),
        ({"user": "u" * 10_000}, "user"),
        ({"input": "word " * 1_000_000}, "store"),
    ],
    ids=[
        "17-pairs",
        "long-key",
        "long-value",
        "10MB-value",
        "5000-keys",
        "text-key",
        "user",
        "entry",
    ],
)
def test_what_the_store_would_not_keep_is_refused(hostile, post, served_name, extra, field):
    hostile(lambda: post(RESPONSES, _body(served_name, **extra)), field=field)


def test_16_mib_of_metadata_is_refused(hostile, post, served_name):
    metadata = {"big": "v" * (16 << 20)}
    answer = hostile(lambda: post(RESPONSES, _body(served_name, metadata=metadata)))
    assert answer.error_field in ("body", "metadata.big")


def test_stats_count_the_store_and_flush_clears_it(post, http, as_key, served_name):
    def stats(key: str) -> dict:
        return http.get("/leyline/v1/stats", headers=as_key(key)).json()

    assert http.post("/leyline/v1/flush", headers=as_key(MALLORY)).status_code == 200
    ours = [post(RESPONSES, _body(served_name, input=f"Hi {k}.")).json() for k in range(3)]
    theirs = post(RESPONSES, _body(served_name), key=ALICE).json()
    counted = stats(MALLORY_2)  # another key of the same tenant
    assert counted["stored_responses"] == 3
    assert counted["stored_response_bytes"] > sum(len(json.dumps(r)) // 2 for r in ours)
    flushed = http.post("/leyline/v1/flush", headers=as_key(MALLORY_2)).json()
    assert flushed["dropped_responses"] == 3
    assert stats(MALLORY)["stored_responses"] == 0
    assert stats(MALLORY)["stored_response_bytes"] == 0
    for r in ours:
        assert http.get(f"{RESPONSES}/{r['id']}", headers=as_key(MALLORY)).status_code == 404
    assert http.get(f"{RESPONSES}/{theirs['id']}", headers=as_key(ALICE)).status_code == 200


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def _spilled(pid: int) -> list[int]:
    """The sizes of the server's store files (its directory under the temporary directory)."""
    dirs = Path(tempfile.gettempdir()).glob(f"{SPILL_PREFIX}{pid}-*")
    return [f.stat().st_size for d in dirs for f in d.iterdir()]


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the RSS from /proc")
def test_large_inputs_stay_within_the_store_budget(live, post, http, as_key, served_name):
    # a scaled run of `leyline bench store-budget` (1 MB inputs: runs/store-budget)
    body = _body(served_name, input=long_input(INPUT_BYTES), max_output_tokens=1)
    assert post(RESPONSES, body).status_code == 200  # the prefix cache and the threads warm
    assert http.post("/leyline/v1/flush", headers=as_key(MALLORY)).status_code == 200
    warm = _rss_mb(live.process.pid)
    for _ in range(LARGE_RESPONSES):
        r = post(RESPONSES, body)
        assert r.status_code == 200, r.text[:300]
    counted = http.get("/leyline/v1/stats", headers=as_key(MALLORY)).json()
    assert counted["stored_responses"] == LARGE_RESPONSES
    assert counted["stored_response_bytes"] >= LARGE_RESPONSES * INPUT_BYTES
    other = http.get("/leyline/v1/stats", headers=as_key(ALICE)).json()  # the other tenant's
    on_disk = _spilled(live.process.pid)  # the entries are files, a newline each besides
    assert len(on_disk) == LARGE_RESPONSES + other["stored_responses"]
    assert sum(on_disk) == sum(
        s["stored_response_bytes"] + s["stored_responses"] for s in (counted, other)
    )
    grown = _rss_mb(live.process.pid) - warm
    assert grown < StoreLimits().tenant_bytes / 2**20, grown  # the documented budget
    flushed = http.post("/leyline/v1/flush", headers=as_key(MALLORY)).json()
    assert flushed["dropped_responses"] == LARGE_RESPONSES
    assert len(_spilled(live.process.pid)) == other["stored_responses"]  # flush deleted ours
    time.sleep(1.5)  # the engine trims once idle
    assert _rss_mb(live.process.pid) - warm < 64, (warm, grown)


def _entry(k: int, size: int) -> StoredResponse:
    return StoredResponse({"id": f"r{k}", "pad": "x" * size}, [{"role": "user", "content": "hi"}])


def _size(e: StoredResponse) -> int:
    return sum(
        len(json.dumps(v, separators=(",", ":")).encode()) for v in (e.response, e.conversation)
    )


def test_the_store_keeps_its_byte_budget_lru_first():
    budget = 10_000
    store = ResponseStore(limits=StoreLimits(tenant_bytes=budget))
    entries = [_entry(k, 900) for k in range(50)]
    sizes = [_size(e) for e in entries]
    for k, e in enumerate(entries):
        store.put("t", f"r{k}", e)
        if k == 5:
            store.get("t", "r0")  # r0 is now the most recently used
    n, nbytes = store.stats("t")
    kept = [k for k in range(50) if store.get("t", f"r{k}") is not None]
    assert nbytes == sum(sizes[k] for k in kept) <= budget
    assert kept == list(range(50 - n, 50))  # the newest, r0 too old by now
    store.put("u", "other", _entry(99, 10))
    assert store.stats("t") == (n, nbytes)  # another tenant's budget is its own


def test_an_entry_past_its_ttl_is_gone():
    store = ResponseStore(limits=StoreLimits(ttl_s=0.05))
    store.put("t", "r", _entry(0, 10))
    assert store.get("t", "r") is not None
    time.sleep(0.1)
    assert store.get("t", "r") is None
    assert store.stats("t") == (0, 0)


def test_entries_live_in_files_and_flush_and_close_remove_them(tmp_path):
    store = ResponseStore(directory=tmp_path / "spill")
    entry = _entry(0, 5000)
    store.put("t", "r0", entry)
    store.put("u", "r1", _entry(1, 10))
    files = sorted((tmp_path / "spill").iterdir())
    assert len(files) == 2
    response, conversation = files[0].read_bytes().split(b"\n")
    assert json.loads(response) == entry.response
    assert json.loads(conversation) == entry.conversation
    assert store.stats("t") == (1, len(response) + len(conversation)) == (1, _size(entry))
    got = store.get("t", "r0")
    assert got is not None and (got.response, got.conversation) == (
        entry.response,
        entry.conversation,
    )
    assert store.forget_tenant("t") == 1
    assert store.get("t", "r0") is None and not files[0].exists() and files[1].exists()
    store.close()
    assert not (tmp_path / "spill").exists()


def test_a_store_removes_the_directories_of_dead_servers(tmp_path, monkeypatch):
    import tempfile

    from leyline_agent.server.responses_store import SPILL_PREFIX

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead, alive = tmp_path / f"{SPILL_PREFIX}999999999-x", tmp_path / f"{SPILL_PREFIX}1-y"
    for d in (dead, alive):
        d.mkdir()
        (d / "0.json").write_text("{}\n[]")
    store = ResponseStore()
    assert store.directory.parent == tmp_path and store.directory.exists()
    assert not dead.exists() and alive.exists()  # pid 1 is running
    store.close()
    assert not store.directory.exists()


def _encoded(http, as_key) -> Callable[[str, dict], Callable[[], httpx.Response]]:
    """A request whose body is encoded here, before the watch starts (encoding 12 MB of JSON
    holds this process's GIL, which the watchers share)."""

    def send(route: str, body: dict) -> Callable[[], httpx.Response]:
        raw = json.dumps(body).encode()
        headers = {**as_key(MALLORY), "Content-Type": "application/json"}
        return lambda: http.post(route, content=raw, headers=headers)

    return send


@pytest.mark.parametrize("route", ["/v1/chat/completions", RESPONSES, "/v1/messages"])
def test_a_body_of_millions_of_values_is_refused_without_stalling(
    hostile, http, as_key, served_name, route
):
    send = _encoded(http, as_key)(route, {"model": served_name, "padding": [0] * 6_000_000})
    hostile(send, field="body")


def test_a_large_body_of_many_values_is_parsed_off_the_loop_and_served(
    hostile, http, as_key, served_name
):
    metadata = {f"k{k}": "v" for k in range(60_000)}  # a hint chat ignores; the yielding scanner
    body = {"model": served_name, "messages": [{"role": "user", "content": "Hi."}]}
    body |= {"max_tokens": 1, "metadata": metadata}
    answer = hostile(_encoded(http, as_key)("/v1/chat/completions", body), ok=True)
    assert answer.status == 200
    assert "metadata" in [i["field"] for i in answer.response.json()["leyline"]["ignored"]]
