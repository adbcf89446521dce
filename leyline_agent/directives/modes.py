"""One rule per directive mode: what a backend does with the tail, and what it counts.

Every backend dispatches on ``rule_of(mode, executes)``, never on an ``if AMORTIZE ... else``:
a mode the backend does not execute is refused by name (``UnsupportedModeError`` naming the
field) before anything is written, instead of running as another mode. A backend does not
list modes: it names the row operations it implements (``ROW_OPS``), and executes the modes
whose rule needs no other (``executed_by``). A new verb is one rule here; until some
backend implements its row operation, every server refuses it by name.

- AMORTIZE: the tail's rows are moved (copied, rotary band turned by delta);
- FORGET: the tail is prefilled afresh after ``R``;
- REPAIR: moved as AMORTIZE, then a selected fraction of its rows (``Directive.budget``) is
  recomputed in place under the edited context (``directives.repair`` selects them).

Torch-free.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from leyline_agent.directives.core import Mode
from leyline_agent.errors import UnsupportedModeError

__all__ = [
    "ALL_MODES",
    "ROW_OPS",
    "ModeRule",
    "RULES",
    "check_modes",
    "executed_by",
    "rule_of",
    "turn_mode",
]

# The row operations a rule may need: "move" (tail rows copied, rotary band turned by delta),
# "prefill" (the tail prefilled afresh after R), "recompute" (selected moved rows recomputed
# in place under the edited context).
ROW_OPS = frozenset({"move", "prefill", "recompute"})


@dataclass(frozen=True, slots=True)
class ModeRule:
    """How one mode treats the tail ``T[end:]`` of its directive."""

    mode: Mode
    tail: str  # the tail's row operation: "move" or "prefill" (ROW_OPS), or a new verb's
    repairs: bool  # after the move, selected tail rows are recomputed in place

    @property
    def moves_tail(self) -> bool:
        return self.tail == "move"

    @property
    def row_ops(self) -> frozenset[str]:
        """The row operations a backend needs to execute this mode."""
        return frozenset({self.tail, *(("recompute",) if self.repairs else ())})


RULES: dict[Mode, ModeRule] = {
    Mode.AMORTIZE: ModeRule(Mode.AMORTIZE, "move", repairs=False),
    Mode.FORGET: ModeRule(Mode.FORGET, "prefill", repairs=False),
    Mode.REPAIR: ModeRule(Mode.REPAIR, "move", repairs=True),
}
ALL_MODES = frozenset(RULES)


def rule_of(
    mode: Mode | str, executes: Iterable[Mode] = ALL_MODES, *, where: str = "mode"
) -> ModeRule:
    """The rule of ``mode`` if this backend ``executes`` it; else ``UnsupportedModeError``
    naming ``where`` (the request field) and the modes it does execute."""
    m = Mode(mode)
    allowed = frozenset(executes)
    if m not in RULES:
        raise UnsupportedModeError(f"{where}: {m.value!r} is reserved, not implemented")
    if m not in allowed:
        names = ", ".join(repr(x.value) for x in sorted(allowed))
        raise UnsupportedModeError(
            f"{where}: {m.value!r} is not executed by this server (it executes {names})"
        )
    return RULES[m]


def executed_by(row_ops: Iterable[str]) -> frozenset[Mode]:
    """The modes a backend implementing ``row_ops`` executes: those whose rule needs no
    other row operation (read when called: a rule added later is seen)."""
    ops = frozenset(row_ops)
    return frozenset(m for m, r in RULES.items() if r.row_ops <= ops)


def check_modes(modes: Iterable[tuple[str, Mode]], executes: Iterable[Mode]) -> None:
    """``rule_of`` for each ``(field, mode)``: the first one not executed is refused."""
    allowed = frozenset(executes)
    for where, mode in modes:
        rule_of(mode, allowed, where=where)


_EXACTNESS = {Mode.AMORTIZE: 0, Mode.REPAIR: 1, Mode.FORGET: 2}


def turn_mode(
    asked: Iterable[tuple[Mode | str | None, float | None]], default: Mode | str
) -> tuple[Mode, float | None]:
    """The one mode (and REPAIR budget) a turn splices its edits in, from each edit's
    ``(mode, budget)``: the most exact mode asked for (FORGET, then REPAIR with the largest
    budget given, then AMORTIZE), so that no edit is spliced less exactly than it asked;
    ``default`` (budget None: the server's) when no edit names a mode."""
    modes = [(Mode(m), b) for m, b in asked if m is not None]
    if not modes:
        return Mode(default), None
    mode = max((m for m, _ in modes), key=lambda m: _EXACTNESS.get(m, -1))
    if mode is not Mode.REPAIR:
        return mode, None
    budgets = [b for m, b in modes if m is Mode.REPAIR and b is not None]
    return mode, max(budgets) if budgets else None
