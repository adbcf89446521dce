"""The vLLM plugin's pin table (pure, main venv): on a simulated block pool with LRU
eviction, a pinned splice result survives a flood; a broken or expired pin whose rows are
then evicted is counted and told once; references taken and given back always balance.
The pool below is written from vLLM's rule (a block with no reference is evictable, least
recently freed first), not from the table."""

from __future__ import annotations

from collections import OrderedDict

import pytest

from leyline_agent.directives.pin_table import DEFAULT_TTL_S, PinTable, Refs
from leyline_agent.vllm_plugin.pins import TTL_ENV, Watch, ttl_from_env


class Pool:
    """Blocks with reference counts and hash keys; ``allocate`` evicts unreferenced blocks
    least recently freed first."""

    def __init__(self, n: int) -> None:
        self.refs = dict.fromkeys(range(n), 0)
        self.key: dict[int, object] = {}
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(n))

    def allocate(self, k: int, key: str) -> list[int]:
        if k > len(self.free):
            raise MemoryError
        out = []
        for _ in range(k):
            b, _ = self.free.popitem(last=False)
            self.key[b] = f"{key}-{b}"
            self.refs[b] = 1
            out.append(b)
        return out

    def apply(self, refs: Refs) -> None:
        for b in refs.take:
            self.refs[b] += 1
            self.free.pop(b, None)
        for b in refs.give_back:
            self.refs[b] -= 1
            assert self.refs[b] >= 0
            if self.refs[b] == 0:
                self.free[b] = None

    def release(self, blocks: list[int]) -> None:
        self.apply(Refs(give_back=tuple(blocks)))


class Rows:
    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.partial_held: set[int] = set()

    def intact(self, ns: str, watch: Watch, with_partial: bool) -> bool:
        ok = all(
            self.pool.key.get(b) == k for b, k in zip(watch.block_ids, watch.keys, strict=True)
        )
        if with_partial and watch.partial is not None:
            ok = ok and watch.partial in self.partial_held
        return ok


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _splice(pool: Pool, table: PinTable, ns: str, n: int, tokens=None) -> Watch:
    blocks = pool.allocate(n, ns)
    w = Watch(tuple(tokens or range(n * 4)), tuple(blocks), tuple(pool.key[b] for b in blocks), ns)
    pool.apply(table.pin(ns, w, w.block_ids, len(w.block_ids)))
    pool.release(blocks)  # the splice's own references end; the pin's stay
    return w


def _flood(pool: Pool, k: int) -> None:
    for _ in range(k):
        pool.release(pool.allocate(len(pool.free), "flood"))


def _setup(n=16, ttl=300.0, budget=8):
    pool, clock = Pool(n), Clock()
    table = PinTable(Rows(pool), ttl, budget=budget, clock=clock, ttl_name=TTL_ENV)
    return pool, clock, table


def test_a_pinned_result_survives_a_flood_and_is_not_reported():
    pool, _, table = _setup()
    w = _splice(pool, table, "A", 3)
    _flood(pool, 3)
    assert all(pool.key[b] == k for b, k in zip(w.block_ids, w.keys, strict=True))
    arrival = table.arrive("A")
    assert (arrival.lost, arrival.watched) == (False, True)
    pool.apply(table.scheduled("A", list(w.tokens) + [1]))
    assert table.pinned() == 0 and table.pin_evictions == 0


def test_without_a_pin_the_same_flood_evicts_and_the_next_request_is_told_once():
    pool, _, table = _setup(ttl=0.0)
    _splice(pool, table, "A", 3)
    assert table.pinned() == 0
    _flood(pool, 1)
    assert table.arrive("A").lost is True
    assert table.arrive("A").lost is False  # told once
    assert table.pin_evictions == 0  # no pin was lost: only the watch told


@pytest.mark.parametrize("how", ["break", "expire"])
def test_a_pin_that_stops_holding_then_loses_its_rows_is_counted(how):
    pool, clock, table = _setup()
    _splice(pool, table, "A", 3)
    if how == "break":
        pool.apply(table.break_oldest())
    else:
        clock.now = DEFAULT_TTL_S + 1
        pool.apply(table.expire())
    assert table.pinned() == 0
    _flood(pool, 1)
    assert table.count_lost() == ["A"] and table.count_lost() == []
    arrival = table.arrive("A")
    assert arrival.lost and not arrival.watched
    assert table.pin_evictions == 1  # counted once (sweep), told once (arrival)
    assert table.arrive("A").lost is False


def test_a_broken_pin_whose_rows_survive_is_not_reported():
    pool, _, table = _setup()
    _splice(pool, table, "A", 3)
    pool.apply(table.break_oldest())
    assert table.count_lost() == []
    assert table.arrive("A").lost is False


def test_the_watch_reports_rows_lost_after_the_pin_ended():
    pool, _, table = _setup()
    w = _splice(pool, table, "A", 3)
    table.arrive("A")
    pool.apply(table.scheduled("A", list(w.tokens) + [7]))
    _flood(pool, 1)
    assert table.arrive("A").lost is True
    assert table.pin_evictions == 0


def test_a_prompt_that_leaves_the_result_ends_the_watch():
    pool, _, table = _setup()
    _splice(pool, table, "A", 3)
    pool.apply(table.scheduled("A", [99, 98, 97]))
    _flood(pool, 1)
    assert table.arrive("A").lost is False and not table.watches("A")


def test_held_partial_rows_count_while_the_pin_lasts():
    pool, _, table = _setup()
    rows = table.rows
    blocks = pool.allocate(2, "A")
    rows.partial_held.add(100)
    w = Watch(tuple(range(9)), tuple(blocks), tuple(pool.key[b] for b in blocks), "A", 100)
    pool.apply(table.pin("A", w, w.block_ids, len(w.block_ids)))
    rows.partial_held.clear()  # dropped from the held-rows table
    assert table.arrive("A").lost is True


def test_pins_stay_within_the_budget_oldest_broken_first():
    pool, _, table = _setup(n=32, budget=6)
    _splice(pool, table, "A", 3)
    _splice(pool, table, "B", 3)
    _splice(pool, table, "C", 3)  # 9 > 6: A's pin gives way
    assert table.pinned() == 6
    assert not table.holds("A") and table.holds("B") and table.holds("C")
    _splice(pool, table, "D", 7)  # alone over the budget: everything gives way
    assert table.pinned() == 0


def test_a_new_directive_replaces_the_pin_and_references_balance():
    pool, _, table = _setup()
    _splice(pool, table, "A", 3)
    _splice(pool, table, "A", 2)
    assert table.pinned() == 2 and table.num_pins == 1
    dropped, refs = table.clear()
    pool.apply(refs)
    assert dropped == 1 and all(v == 0 for v in pool.refs.values())


def test_ttl_from_env():
    assert ttl_from_env({}) == DEFAULT_TTL_S
    assert ttl_from_env({TTL_ENV: "0"}) == 0.0
    for bad in ("-1", "soon", "inf", "nan"):
        with pytest.raises(ValueError, match=TTL_ENV):
            ttl_from_env({TTL_ENV: bad})
