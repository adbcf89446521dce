"""HTTP wire models of the Leyline routes (``/leyline/v1/...``), and the counters behind stats.

Shared by the server (``leyline serve``, the SGLang plugin's route) and the agent-side
``HTTPRuntime``. Frozen pydantic models; no torch, no engine imports. ``Counters`` is the
one counter model every serving side keeps (the embedded engine per tenant, the SGLang
plugin per process); ``StatsResponse`` is its wire form.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from leyline_agent.edits import Directive, ImplementedMode, Mode

__all__ = [
    "BODY_EDITS",
    "CLIENT_EDITS",
    "Counters", "DirectivesRequest", "DirectivesResponse", "ErrorBody",
    "StatsResponse",
]

_FROZEN = ConfigDict(frozen=True, extra="forbid")


class DirectivesRequest(BaseModel):
    """``POST /leyline/v1/directives``: exactly one of two forms.

    Token form: ``tokens`` is the cached sequence T, ``directives`` act on its positions.
    Message form: ``old_messages`` is what the serving side has cached (the last prompt plus
    the assistant reply), ``new_messages`` the same list after the policies' edits; the
    server renders both with the chat template (and ``tools``) and compiles the token spans
    where they differ into directives of ``mode``.
    ``fallback``: if the base is not cached, don't fail; count it and let the next request
    re-prefill (FORGET semantics).

    Strict: no value is coerced (``"812"``, ``5.0``, ``true`` are not token ids); ``mode``
    takes its string value, and a reserved mode is refused by name.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    model: str | None = None
    tokens: list[int] | None = None
    directives: list[Directive] | None = None
    old_messages: list[dict[str, Any]] | None = None
    new_messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    mode: ImplementedMode = Field(default=Mode.AMORTIZE, strict=False)
    budget: float | None = Field(
        default=None,
        ge=0.0,
        le=1.0,
        strict=False,
        description="message form, mode 'repair': the fraction of each tail recomputed "
        "(none: the server's default)",
    )
    fallback: bool = False
    session: str | None = Field(
        default=None,
        description="the session whose spliced rows this directive reads and writes "
        "(the X-Leyline-Session header names it too); none: the tenant's anonymous session",
    )
    request_id: str | None = Field(
        default=None,
        description="idempotency key: a retry with the same id (same tenant) gets the first "
        "answer and executes nothing",
    )

    @model_validator(mode="after")
    def _one_form(self) -> DirectivesRequest:
        token_form = self.tokens is not None or self.directives is not None
        message_form = self.old_messages is not None or self.new_messages is not None
        if token_form == message_form:
            raise ValueError(
                "give either tokens+directives (token form) or old_messages+new_messages "
                "(message form), not both and not neither"
            )
        if token_form and (self.tokens is None or self.directives is None):
            raise ValueError("token form needs both 'tokens' and 'directives'")
        if message_form and (self.old_messages is None or self.new_messages is None):
            raise ValueError("message form needs both 'old_messages' and 'new_messages'")
        if self.budget is not None and (token_form or self.mode is not Mode.REPAIR):
            raise ValueError(
                "budget: message form with mode 'repair' only (token form: each directive's)"
            )
        return self


class DirectivesResponse(BaseModel):
    model_config = _FROZEN

    outcome: Literal["applied", "noop", "fallback"] = Field(
        default="applied",
        description="applied: directives executed; noop: nothing to change (old == new); "
        "fallback: nothing executed because the base was not cached (counted in stats)",
    )
    tokens: list[int] = Field(description="the new cached sequence T'")
    applied: list[Directive] = Field(description="compiled directives, in execution order")
    splices: dict[str, int] = Field(default_factory=dict, description="executed, by mode")
    fallback: bool = Field(default=False, description="base not cached; next request re-prefills")
    cached_base_tokens: int = Field(
        default=0, description="leading tokens of the base T the namespace found cached"
    )
    reused_tokens: int = 0
    prefilled_tokens: int = 0
    rotated_tokens: int = 0
    repaired_tokens: int = Field(default=0, description="tail rows recomputed by REPAIR")
    elapsed_s: float = 0.0


BODY_EDITS = "body_edits"  # StatsResponse.features: `leyline.edits` in chat bodies
CLIENT_EDITS = "client_edits"  # StatsResponse.features: undeclared client edits found too


class StatsResponse(BaseModel):
    """``GET /leyline/v1/stats``: cumulative counters of one serving process (of one tenant,
    where the serving side keeps them per tenant: every counter is the tenant's own)."""

    model_config = _FROZEN

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    prefilled_tokens: int = 0
    generated_tokens: int = 0
    splices: dict[str, int] = Field(default_factory=lambda: {"amortize": 0, "forget": 0})
    rotated_tokens: int = 0
    repaired_tokens: int = 0
    fallbacks: int = 0
    directive_errors: int = 0
    cache_tokens: int = 0
    cache_capacity_tokens: int = 0
    cache_share_tokens: int | None = Field(
        default=None,
        description="rows a tenant may hold before its own rows are evicted first "
        "(leyline serve --tenant-cache-share); none: no shares",
    )
    evicted_tokens: int = Field(default=0, description="rows of this tenant's evicted")
    drift_splices: int = Field(
        default=0,
        description="chat turns whose prompt drifted from the cached tokens in a few spans "
        "(a template's stripped thinking, a changed head line) and were spliced",
    )
    drift_unspliced: dict[str, int] = Field(
        default_factory=dict,
        description="drifts found but not spliced, by reason: unproven (the request did not "
        "echo the reply), not_cached, error, max_gap / max_spans (beyond the diff's bounds)",
    )
    pinned_tokens: int = Field(default=0, description="splice results held for their session")
    pin_evictions: int = Field(
        default=0, description="splice results evicted before their session's next request"
    )
    ignored_fields: dict[str, int] = Field(
        default_factory=dict,
        description="request fields accepted as OpenAI hints and not acted on, by field "
        "(each answer lists its own in leyline.ignored)",
    )
    stored_responses: int = Field(
        default=0, description="the tenant's stored Responses (/v1/responses, store: true)"
    )
    stored_response_bytes: int = Field(
        default=0, description="their size, as compact JSON (bounded per tenant)"
    )
    tenant: str | None = Field(default=None, description="whose counters these are (per key)")
    features: tuple[str, ...] = Field(
        default=(),
        description="optional front features this server has; BODY_EDITS: it applies a chat "
        "request's `leyline.edits` in the turn's own job; CLIENT_EDITS: it also finds edits a "
        "client made without declaring them (`leyline.client_edits` on, conversations by "
        "content)",
    )


def _no_splices() -> dict[str, int]:
    return {"amortize": 0, "forget": 0}


@dataclass(slots=True)
class Counters:
    """Cumulative counters of a serving side (mutable; ``to_stats`` is the wire form)."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    prefilled_tokens: int = 0
    generated_tokens: int = 0
    splices: dict[str, int] = field(default_factory=_no_splices)
    rotated_tokens: int = 0
    repaired_tokens: int = 0  # tail rows recomputed by REPAIR
    fallbacks: int = 0
    directive_errors: int = 0
    evicted_tokens: int = 0  # this tenant's rows evicted (whoever's request pushed them out)
    pin_evictions: int = 0  # this tenant's splice results lost before their session came back
    drift_splices: int = 0  # chat turns whose token drift was spliced (front/chat_turn.py)
    drift_unspliced: dict[str, int] = field(default_factory=dict)  # found, not spliced: why

    def count_generation(self, prompt_tokens: int, cached_tokens: int, generated: int) -> None:
        """One finished generation request."""
        self.requests += 1
        self.prompt_tokens += prompt_tokens
        self.cached_tokens += cached_tokens
        self.prefilled_tokens += prompt_tokens - cached_tokens
        self.generated_tokens += generated

    def count_directive(self, resp: DirectivesResponse) -> None:
        """One answered directive request: its splices, rotated rows, and a fallback."""
        for mode, n in resp.splices.items():
            self.splices[mode] = self.splices.get(mode, 0) + n
        self.rotated_tokens += resp.rotated_tokens
        self.repaired_tokens += resp.repaired_tokens
        self.fallbacks += int(resp.fallback)

    @classmethod
    def total(cls, parts: Iterable[Counters]) -> Counters:
        out = cls()
        for part in parts:
            for f in fields(cls):
                if isinstance(getattr(part, f.name), dict):  # splices, drift_unspliced
                    mine, theirs = getattr(out, f.name), getattr(part, f.name)
                    for key, n in theirs.items():
                        mine[key] = mine.get(key, 0) + n
                else:
                    setattr(out, f.name, getattr(out, f.name) + getattr(part, f.name))
        return out

    def to_stats(self, **cache: Any) -> StatsResponse:
        """The wire form; ``cache`` adds the cache fields a serving side knows of."""
        counts = {f.name: getattr(self, f.name) for f in fields(self)}
        copies = {"splices": dict(self.splices), "drift_unspliced": dict(self.drift_unspliced)}
        return StatsResponse(**counts | copies, **cache)


class ErrorBody(BaseModel):
    """Body of every 4xx/5xx answer, shaped as OpenAI's: ``{"error": {"message", "type",
    "param", "code", "field", "leyline_type"}}``.

    ``type`` is OpenAI's error type (``invalid_request_error``, ``authentication_error``,
    ``not_found_error``, ``rate_limit_error``, ``server_error``...; ``http_errors``);
    ``leyline_type`` the Leyline error class name (clients raise the same class; None from a
    server that predates it, whose ``type`` was that name); ``param`` is the request field at
    fault, as a path (``messages[2].role``), where the OpenAI SDK reads it, and ``field`` the
    same value under its older name; ``code`` a short snake_case reason (``invalid_value``,
    ``model_not_found``, ``cache_miss``, pydantic's ``missing``...)."""

    model_config = _FROZEN

    message: str
    type: str
    leyline_type: str | None = None
    param: str | None = None
    code: str | None = None
    field: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _param_is_field(cls, data: Any) -> Any:
        if isinstance(data, dict):
            param = data.get("param", data.get("field"))
            data = {**data, "param": param, "field": data.get("field", param)}
        return data
