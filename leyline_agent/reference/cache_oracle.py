"""An independent model of what a provenance-aware prefix cache must serve, with its KV.

The values come from ``kv_reference`` (the model's own modules, forward hooks, its own
rotary function at absolute positions), never from the runtime's pool, tree or kernels.
The cache policy is modelled with plain dictionaries over token prefixes, not a tree:

- ``exact[tenant]``: the set of token prefixes whose exact rows the tenant has cached (an
  exact row's value is a fresh prefill's, so only *whether* it is cached is recorded).
- ``own[(tenant, session)]``: prefix tuple -> the ``Row`` at its last position, for rows
  that came from an AMORTIZE (or were computed after such a row).

A lookup takes the namespace's own row for a prefix when there is one, else the exact row;
once it has taken an own row it can only continue on own rows. A write of ``X`` whose rows
are exact up to ``e``: each exact position ``i`` records ``X[:i+1]`` as cached and removes
the namespace's own rows of ``X[:i+1]`` and beyond; from ``e`` on, rows are the namespace's
own and the latest write wins (an own row that is not the very row being written is
replaced, with everything after it).

Evictions are not modelled: a test that evicts checks that the engine never reuses more
than the oracle allows, and then takes the engine's shorter match (``OracleMatch.upto``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from leyline_agent.reference.kv_reference import RefState, Row, logits_from_kv

__all__ = ["CacheOracle", "OracleMatch"]

NS = tuple[str, str | None]  # (tenant, session or None)


@dataclass
class OracleMatch:
    length: int
    rows: list[Row]
    exact_len: int  # leading rows that are exact

    def upto(self, length: int) -> OracleMatch:
        """The first ``length`` rows of this match (what an engine that evicted the rest
        can still serve)."""
        if length > self.length:
            raise ValueError(f"upto: {length} > {self.length}")
        return OracleMatch(length, self.rows[:length], min(self.exact_len, length))


@dataclass
class CacheOracle:
    model: object
    exact: dict[str, set[tuple[int, ...]]] = field(default_factory=dict)
    own: dict[NS, dict[tuple[int, ...], Row]] = field(default_factory=dict)
    _prefills: dict[tuple[int, ...], RefState] = field(default_factory=dict)

    # ---------------------------------------------------------------- reading
    def match(self, ns: NS, tokens: Sequence[int]) -> OracleMatch:
        own, ex = self.own.get(ns, {}), self.exact.get(ns[0], set())
        n, exact_len, in_own, picked = 0, None, False, []
        for i in range(len(tokens)):
            k = tuple(tokens[: i + 1])
            if k in own:
                if not in_own:
                    in_own, exact_len = True, i
                picked.append(own[k])
            elif not in_own and k in ex:
                picked.append(None)
            else:
                break
            n = i + 1
        exact_len = n if exact_len is None else exact_len
        exact_rows = self.exact_rows(tokens[:exact_len])
        return OracleMatch(n, exact_rows + picked[exact_len:], exact_len)

    def exact_rows(self, tokens: Sequence[int]) -> list[Row]:
        if not tokens:
            return []
        key = tuple(tokens)
        st = self._prefills.get(key)
        if st is None:
            st = self._prefills[key] = RefState.prefill(self.model, list(tokens))
        return st.rows()

    def logits(
        self, tokens: Sequence[int], rows: Sequence[Row], new: Sequence[int]
    ) -> torch.Tensor:
        """Next-token logits of ``tokens + new`` with ``rows`` as the cache of ``tokens``."""
        st = RefState.from_rows(self.model, tokens, rows)
        return logits_from_kv(self.model, st.kv() if rows else _empty_kv(self.model), new)

    # ---------------------------------------------------------------- operations
    def generated(self, ns: NS, prompt: Sequence[int], out: Sequence[int], m: OracleMatch) -> None:
        """The engine served ``prompt`` from ``m`` and produced ``out``: record ``prompt+out``."""
        seq = list(prompt) + list(out)
        st = RefState.from_rows(self.model, seq[: m.length], m.rows)
        new = st.extend(seq[m.length :]).rows(m.length)
        exact = len(seq) if m.exact_len == m.length else m.exact_len
        self.write(ns, seq, list(m.rows) + new, exact)

    def directives(
        self, ns: NS, base: Sequence[int], order: Sequence[dict], m: OracleMatch
    ) -> list[int]:
        """Apply directives (execution order) to the cached ``base``; return T'."""
        tokens, rows, exact = list(base), list(m.rows), m.exact_len
        for d in order:
            s, e, r = d["start"], d["end"], list(d["replacement"])
            head = RefState.from_rows(self.model, tokens[:s], rows[:s])
            new_len = len(tokens) + len(r) - (e - s)
            if d["mode"] == "amortize":
                r_rows = head.extend(r).rows(s)
                tail = [Row(x.plain, x.pre) for x in rows[e:]]  # moved: new rows
                rows = rows[:s] + r_rows + tail
                if exact >= s:
                    exact = s + len(r) if tail else new_len
            else:
                rows = rows[:s] + head.extend(r + tokens[e:]).rows(s)
                if exact >= s:
                    exact = new_len
            tokens = tokens[:s] + r + tokens[e:]
        if order:
            self.write(ns, tokens, rows, min(exact, len(tokens)))
        return tokens

    def write(self, ns: NS, tokens: Sequence[int], rows: Sequence[Row], exact_len: int) -> None:
        own = self.own.setdefault(ns, {})
        ex = self.exact.setdefault(ns[0], set())
        for i in range(exact_len):
            k = tuple(tokens[: i + 1])
            ex.add(k)
            if k in own:
                _drop_from(own, k)
        for i in range(exact_len, len(tokens)):
            k = tuple(tokens[: i + 1])
            if own.get(k) is rows[i]:
                continue
            _drop_from(own, k)  # the first new row: every own row from here on is older
            for j in range(i, len(tokens)):
                own[tuple(tokens[: j + 1])] = rows[j]
            break


def _drop_from(own: dict[tuple[int, ...], Row], k: tuple[int, ...]) -> None:
    for x in [x for x in own if x[: len(k)] == k]:
        del own[x]


def _empty_kv(model) -> list[tuple[torch.Tensor, torch.Tensor]]:
    z = torch.zeros(1, 1, 0, 1)
    return [(z, z) for _ in range(model.config.num_hidden_layers)]
