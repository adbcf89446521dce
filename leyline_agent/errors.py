"""One root error and a few precise subclasses.

Every error that reaches a user names the field, message index or argument at fault.
User input is validated by raising these, never by ``assert``.
"""

from __future__ import annotations


class LeylineError(Exception):
    """Root of every error Leyline raises on purpose."""


class DirectiveError(LeylineError, ValueError):
    """A directive (or a batch of them) is malformed or does not fit its sequence."""


class UnsupportedModeError(DirectiveError):
    """A reserved verb (PIN, DECAY, SCRATCH) that is not implemented yet."""


class TrajectoryError(LeylineError, ValueError):
    """A message list is malformed: missing role, unpaired tool result, bad content."""


class PolicyError(LeylineError, ValueError):
    """An unknown policy name or a bad policy knob."""


class InvalidRequestError(LeylineError, ValueError):
    """A request's field is malformed or out of range; ``field`` names it (the message
    starts with it too: ``"prompt_ids[3]: ..."``)."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field
        self.detail = message


class RequestError(InvalidRequestError):
    """A request every Leyline front refuses before any engine work: a bad value, a bound
    passed, an unsupported option (400 on every engine, ``leyline_type`` ``RequestError``)."""

    status = 400


class ModelNotFoundError(InvalidRequestError):
    """The request names a model the server does not serve (404 on every Leyline route)."""

    def __init__(self, message: str, field: str | None = "model") -> None:
        super().__init__(message, field)


class CacheMissError(LeylineError, LookupError):
    """A directive's base sequence is not (or no longer) in the prefix cache."""


class RopeSpecError(LeylineError, ValueError):
    """A model's rotary embedding cannot be moved by a closed-form rotation."""


class RuntimeUnavailableError(LeylineError, RuntimeError):
    """The serving side (server, engine, SGLang) cannot be reached or cannot run here."""
