"""Tenants apart over real HTTP, on a real ``leyline serve`` with a key file of two tenants.

Expected values are bookkeeping done here, not read from the server: each completion of a
fresh prompt (no prefix shared with any other) caches its prompt and its one output token,
so a tenant's evicted rows are the rows its requests cached less the rows it still holds;
and a repeat of a cached prompt finds all of it but the last token cached.

- With ``--tenant-cache-share 0.5``, tenant A's flood evicts A's own rows: B's stats stay
  exactly what they were, and B's next request finds its rows cached.
- Without a share (the same flood, the same cache), B's rows are evicted and counted as B's:
  the share is what protected them.
"""

from __future__ import annotations

import httpx
import pytest

from leyline_agent.testing.server import serve_in_process
from leyline_agent.testing.token_ids import random_ids

pytestmark = pytest.mark.slow

CACHE_TOKENS = 600
PROMPT = 200  # each cached prompt + output: 201 rows; two of them pass one tenant's share
FLOOD = 5
KEYS = {"alpha": "alpha-key", "beta": "beta-key"}


@pytest.fixture(scope="module")
def key_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys.txt"
    path.write_text("# two tenants\n" + "".join(f"{k} {t}\n" for t, k in KEYS.items()))
    return path


def _prompts() -> dict[str, list[list[int]]]:
    b = [random_ids(700, PROMPT)]
    a = [random_ids(701 + k, PROMPT) for k in range(FLOOD)]
    firsts = [p[0] for p in a + b]
    assert len(set(firsts)) == len(firsts), "the prompts must share no prefix"
    return {"beta": b, "alpha": a}


def _complete(c: httpx.Client, name: str, tenant: str, ids: list[int]) -> dict:
    r = c.post(
        "/v1/completions",
        json={"model": name, "prompt": ids, "max_tokens": 1, "temperature": 0},
        headers={"Authorization": f"Bearer {KEYS[tenant]}"},
    )
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def _stats(c: httpx.Client, tenant: str) -> dict:
    r = c.get("/leyline/v1/stats", headers={"Authorization": f"Bearer {KEYS[tenant]}"})
    assert r.status_code == 200, r.text
    return r.json()


def _flood(model_dir, key_file, *share: str) -> dict:
    """B caches one prompt, A floods, B comes back: the stats and B's cached tokens."""
    prompts, name = _prompts(), model_dir.name
    args = ("--api-key-file", str(key_file), "--cache-tokens", str(CACHE_TOKENS), *share)
    with (
        serve_in_process(model_dir, *args) as srv,
        httpx.Client(base_url=srv.url, timeout=120) as c,
    ):
        _complete(c, name, "beta", prompts["beta"][0])
        beta_before = _stats(c, "beta")
        for p in prompts["alpha"]:
            _complete(c, name, "alpha", p)
        out = {"beta_before": beta_before, "beta_after": _stats(c, "beta")}
        out["alpha"] = _stats(c, "alpha")
        back = _complete(c, name, "beta", prompts["beta"][0][:-1] + [17])
        out["beta_cached"] = back["prompt_tokens_details"]["cached_tokens"]
    return out


def _evicted_by_bookkeeping(stats: dict, requests: int) -> int:
    """Rows a tenant cached (prompt + 1 output token per fresh request) less what it holds."""
    return requests * (PROMPT + 1) - stats["cache_tokens"]


def test_with_a_share_another_tenants_flood_leaves_b_alone(model_dir, key_file):
    out = _flood(model_dir, key_file, "--tenant-cache-share", "0.5")
    alpha = out["alpha"]
    assert alpha["evicted_tokens"] > 0  # the flood really evicted
    assert alpha["evicted_tokens"] == _evicted_by_bookkeeping(alpha, FLOOD)
    assert alpha["cache_tokens"] <= CACHE_TOKENS // 2 and alpha["cache_share_tokens"] == 300
    assert out["beta_after"] == out["beta_before"]  # every counter of B, unchanged
    assert out["beta_before"]["cache_tokens"] == PROMPT + 1
    assert out["beta_before"]["evicted_tokens"] == 0
    assert out["beta_cached"] == PROMPT - 1  # B's rows survived: all but the changed token


def test_without_a_share_the_flood_evicts_b_and_b_is_told(model_dir, key_file):
    out = _flood(model_dir, key_file)
    beta, alpha = out["beta_after"], out["alpha"]
    assert beta["cache_share_tokens"] is None
    assert beta["cache_tokens"] < PROMPT + 1  # LRU over everybody: B's older rows went first
    assert beta["evicted_tokens"] == _evicted_by_bookkeeping(beta, 1) > 0
    assert alpha["evicted_tokens"] == _evicted_by_bookkeeping(alpha, FLOOD)
    assert beta["requests"] == out["beta_before"]["requests"]  # A's requests are not B's
    assert out["beta_cached"] < PROMPT - 1
