"""The table of held rows (``directives.held_rows``, vLLM's), without a server: which rows a
request may be handed, and that every block that leaves the table is given back.

The expected answers are computed here from scratch (a brute-force longest common prefix),
not with the table's own helpers."""

from __future__ import annotations

import random

from leyline_agent.directives.held_rows import PER_NAMESPACE, HeldRows, HeldRowsTable

B = 32


class Blk:
    def __init__(self, i: int) -> None:
        self.block_id = i


def _table(max_entries: int = 64) -> tuple[HeldRowsTable, list[int]]:
    released: list[int] = []
    return HeldRowsTable(lambda b: released.append(b.block_id), max_entries), released


def _expected(held: list[int], base: int, prompt: list[int], num_local: int) -> int:
    if base != num_local or held[:base] != prompt[:base]:
        return 0
    k = base
    while k < min(len(held), len(prompt) - 1) and held[k] == prompt[k]:
        k += 1
    return k - base


def test_match_is_the_common_prefix_inside_the_held_block_never_the_last_token():
    rng = random.Random(0)
    for trial in range(300):
        n = rng.randrange(B + 1, 4 * B)
        held = [rng.randrange(50) for _ in range(n)]
        base = (n // B) * B
        if n == base:
            continue
        cut = rng.randrange(0, n + 3)
        prompt = held[:cut] + [rng.randrange(50) for _ in range(rng.randrange(0, 9))]
        num_local = rng.choice([base, base - B, base + B]) if base else 0
        table, _ = _table()
        table.add("ns", HeldRows(tuple(held), base, Blk(trial), "salt"))
        got = table.match("ns", "salt", prompt, num_local, B)
        want = _expected(held, base, prompt, num_local)
        assert (got.num_rows if got else 0) == want, (n, cut, len(prompt), num_local)
        assert table.match("other-ns", "salt", prompt, num_local, B) is None
        assert table.match("ns", "other-salt", prompt, num_local, B) is None


def test_every_block_that_leaves_is_released_once():
    table, released = _table(max_entries=6)
    n = 0
    for ns in ("a", "b", "c"):
        for j in range(PER_NAMESPACE + 2):  # two more than a namespace keeps
            table.add(ns, HeldRows(tuple(range(j, j + B + 5)), B, Blk(n), None))
            n += 1
    assert len(table) <= 6
    assert len(released) + len(table) == n and len(set(released)) == len(released)
    table.add("c", HeldRows(tuple(range(B)), B, Blk(99), None))  # no rows past the base
    assert 99 in released
    kept = len(table)
    assert table.clear() == kept and len(released) == n + 1 and len(table) == 0


def test_a_forget_drops_the_rows_past_its_start_only():
    table, released = _table()
    t = list(range(100, 100 + 2 * B + 9))
    table.add("ns", HeldRows(tuple(t), 2 * B, Blk(1), "s"))  # agrees with T' past start
    table.add("ns", HeldRows(tuple(t[: B + 4]), B, Blk(2), "s"))  # T[:start]: staged rows
    new = t[: B + 4] + [7, 8] + t[B + 10 :]
    assert table.drop_past("ns", new, B + 4) == 0  # T' differs from T right at start
    assert table.drop_past("ns", t, B + 4) == 1 and released == [1]
    assert table.match("ns", "s", new, B, B).num_rows == 4


def test_holds_start_and_find():
    table, _ = _table()
    t = list(range(5, 25))
    table.add("ns", HeldRows(tuple(t), 0, Blk(3), "s"))
    assert table.holds_start("ns", "s", t[:1] + [0])
    assert not table.holds_start("ns", "s", [0])
    assert not table.holds_start("ns", "x", t)
    # a prompt whose first block is full: every held row must be the prompt's (T[:s] staged
    # for a FORGET or a head with s in the first block), a shared first token is not enough
    assert table.holds_start("ns", "s", t + [1, 2, 3], whole=True)
    assert not table.holds_start("ns", "s", t[:1] + [0] * 30, whole=True)
    assert not table.holds_start("ns", "s", t[:-1] + [0] * 30, whole=True)
    found = table.find("ns", "s", t[:12] + [0, 0], 0)
    assert found is not None and list(found.tokens) == t[:12] and found.block_id == 3
