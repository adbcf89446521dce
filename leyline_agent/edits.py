"""Wire contracts: token-level directives and message-level edits (a root contract module:
it imports only ``errors``; ``directives.core`` re-exports it for the directives layer).

``Directive`` is the paper's 4-tuple ``D = (start, end, replacement, mode)`` over the token
positions of one cached sequence ``T``: the span ``T[start:end]`` is replaced by
``replacement`` and the result is ``T' = T[:start] + replacement + T[end:]``. Every later
token moves by ``delta = len(replacement) - (end - start)``.

``MessageEdit`` is what policies emit: which message of the trajectory changes and what
replaces its content (or its tool calls). Compiling edits into directives needs the chat
template and the tokenizer, so it happens on the serving side.

Both are frozen pydantic models because they cross a process boundary. Nothing here
imports torch or the engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from leyline_agent.errors import DirectiveError, UnsupportedModeError

__all__ = [
    "Directive",
    "ImplementedMode",
    "MessageEdit",
    "Mode",
    "RESERVED_MODES",
    "check_mode",
    "plan_batch",
    "splice_tokens",
]


class Mode(StrEnum):
    """What happens to the tail after the edited span.

    AMORTIZE: in-place splice. The prefix stays, the replacement is prefilled into new
        slots, the tail keeps its latent/values and its rotary band is re-rotated by delta.
    FORGET: prefix-trimmed re-prefill: the prefix stays, replacement + tail are prefilled
        fresh, so nothing of the removed span survives in the tail's KV.
    REPAIR: AMORTIZE, then the KV of a few selected tail rows (``Directive.budget``, a
        fraction of the tail) is recomputed under the edited context, in place: budget 0 is
        AMORTIZE, budget 1 is FORGET. ``directives.modes`` holds each mode's rule.
    PIN, DECAY, SCRATCH: reserved by the paper for future work; rejected until they exist.
    """

    AMORTIZE = "amortize"
    FORGET = "forget"
    REPAIR = "repair"
    PIN = "pin"
    DECAY = "decay"
    SCRATCH = "scratch"


RESERVED_MODES = frozenset({Mode.PIN, Mode.DECAY, Mode.SCRATCH})


def check_mode(mode: Mode) -> Mode:
    """``mode`` if it is implemented; ``ValueError`` naming a reserved one."""
    if mode in RESERVED_MODES:
        raise ValueError(
            f"mode {mode.value!r} is reserved for a future release; use 'amortize', 'forget' or 'repair'"
        )
    return mode


def _mode_of(value: Any) -> Any:
    """A mode's string value as the ``Mode`` (also under strict validation); another string
    is refused naming the implemented modes."""
    if isinstance(value, str) and not isinstance(value, Mode):
        try:
            return Mode(value)
        except ValueError:
            raise ValueError(
                f"{value!r} is not a mode; use 'amortize', 'forget' or 'repair'"
            ) from None
    return value


# A mode that is implemented: a reserved one is refused by name.
ImplementedMode = Annotated[Mode, AfterValidator(check_mode)]

_FROZEN = ConfigDict(frozen=True, extra="forbid")
# Strict: no coercion ("812", 5.0 and true are not positions or token ids). ``mode`` alone is
# lax, so that its string value ("amortize") is accepted from Python as from JSON.
_STRICT = ConfigDict(frozen=True, extra="forbid", strict=True)


class Directive(BaseModel):
    """Replace ``T[start:end]`` of a cached sequence by ``replacement``.

    ``replacement`` is a list of token ids, or text that whoever owns the tokenizer
    compiles to ids before execution (see ``is_compiled``).
    """

    model_config = _STRICT

    start: int = Field(ge=0, description="first replaced position (inclusive)")
    end: int = Field(ge=0, description="one past the last replaced position")
    replacement: list[int] | str = Field(default_factory=list)
    mode: ImplementedMode = Field(default=Mode.AMORTIZE, strict=False)
    budget: float | None = Field(
        default=None,
        ge=0.0,
        le=1.0,
        description="mode 'repair' only: the fraction of the tail's rows recomputed "
        "(none: the serving side's default)",
    )

    @field_validator("replacement")
    @classmethod
    def _ids_non_negative(cls, v: list[int] | str) -> list[int] | str:
        if isinstance(v, list):
            for k, t in enumerate(v):
                if t < 0:
                    raise ValueError(f"replacement[{k}] = {t} is not a token id (must be >= 0)")
        return v

    @model_validator(mode="after")
    def _ordered(self) -> Directive:
        if self.start > self.end:
            raise ValueError(f"start ({self.start}) must be <= end ({self.end})")
        if self.budget is not None and self.mode is not Mode.REPAIR:
            raise ValueError(f"budget applies to mode 'repair' only, not {self.mode.value!r}")
        return self

    @property
    def is_compiled(self) -> bool:
        return isinstance(self.replacement, list)

    @property
    def removed(self) -> int:
        return self.end - self.start

    @property
    def delta(self) -> int:
        """How far every tail token moves: |R| - |S|. Needs compiled token ids."""
        if not isinstance(self.replacement, list):
            raise DirectiveError("replacement: delta needs token ids, not text; compile it first")
        return len(self.replacement) - self.removed

    @classmethod
    def parse(cls, data: Any, *, where: str = "directive") -> Directive:
        """Validate ``data`` into a Directive, re-raising as DirectiveError naming the field."""
        if isinstance(data, Directive):
            return data
        try:
            return cls.model_validate(data)
        except ValueError as e:  # pydantic.ValidationError is a ValueError
            if isinstance(data, dict) and str(data.get("mode", "")).lower() in {
                m.value for m in RESERVED_MODES
            }:
                raise UnsupportedModeError(
                    f"{where}.mode: {data['mode']!r} is reserved, not implemented"
                ) from e
            raise DirectiveError(f"{where}: {_first_error(e)}") from e


def plan_batch(
    directives: Sequence[Directive | dict], seq_len: int | None = None
) -> list[Directive]:
    """Validate a batch and return it in execution order: right to left.

    Applying right to left keeps every earlier directive's positions valid. Spans may not
    overlap (two empty insertions at the same position are ambiguous and rejected too);
    with ``seq_len`` given, every ``end`` must be <= seq_len.
    """
    parsed = [Directive.parse(d, where=f"directives[{i}]") for i, d in enumerate(directives)]
    order = sorted(range(len(parsed)), key=lambda i: (parsed[i].start, parsed[i].end))
    for a, b in zip(order, order[1:], strict=False):
        da, db = parsed[a], parsed[b]
        if db.start < da.end or (db.start == da.start):
            raise DirectiveError(
                f"directives[{b}]: span [{db.start}, {db.end}) overlaps directives[{a}] "
                f"span [{da.start}, {da.end})"
            )
    if seq_len is not None:
        for i, d in enumerate(parsed):
            if d.end > seq_len:
                raise DirectiveError(
                    f"directives[{i}].end: {d.end} is past the end of the sequence (length {seq_len})"
                )
    return [parsed[i] for i in reversed(order)]


def splice_tokens(tokens: Sequence[int], directives: Sequence[Directive | dict]) -> list[int]:
    """The token sequence T' that a batch of compiled directives produces (pure; executing a
    request on a KV cache is ``Engine.apply_directives``)."""
    out = list(tokens)
    for d in plan_batch(directives, seq_len=len(out)):
        if not isinstance(d.replacement, list):
            raise DirectiveError("replacement: text must be compiled to token ids first")
        out[d.start : d.end] = d.replacement
    return out


class MessageEdit(BaseModel):
    """A policy's edit of one message of the trajectory.

    ``content`` replaces the message's content; ``tool_calls`` (assistant messages only)
    replaces its tool calls (same ids, e.g. with stubbed arguments). At least one is set.
    Messages are never inserted or removed, so indices stay stable across turns.
    ``mode`` / ``budget``: the splice the edit asks for (a policy's ``mode`` knob); one turn
    splices its edits in one mode, the most exact one asked for (``modes.turn_mode``).
    """

    model_config = _FROZEN

    index: int = Field(ge=0, description="index of the message in the trajectory")
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    policy: str = Field(min_length=1, description="name of the policy that made the edit")
    reason: str = ""
    mode: Annotated[Mode, BeforeValidator(_mode_of), AfterValidator(check_mode)] | None = Field(
        default=None,
        description="the splice mode the edit asks for (none: the session's or server's)",
    )
    budget: float | None = Field(
        default=None, ge=0.0, le=1.0, description="mode 'repair' only: the tail fraction recomputed"
    )

    @model_validator(mode="after")
    def _something_changes(self) -> MessageEdit:
        if self.content is None and self.tool_calls is None:
            raise ValueError("an edit must set content or tool_calls")
        if self.budget is not None and self.mode is not Mode.REPAIR:
            raise ValueError("budget applies to mode 'repair' only")
        return self


def _first_error(e: Exception) -> str:
    errors = getattr(e, "errors", None)
    if callable(errors):
        errs = errors()
        if errs:
            loc = ".".join(str(x) for x in errs[0].get("loc", ()))
            msg = errs[0].get("msg", str(e))
            return f"{loc}: {msg}" if loc else msg
    return str(e)
