"""Between the OpenAI wire format and the engine: checks, sampling parameters, answers.

Everything a request can get wrong is checked here, before the engine is asked to do
anything, so that a refused request leaves the engine's stats and cache untouched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from leyline_agent.chat_input import canonical_messages, canonical_tools
from leyline_agent.directives import validate
from leyline_agent.directives.validate import check_message_shapes
from leyline_agent.engine.grammar_spec import GrammarSpec
from leyline_agent.engine.params import GREEDY_BELOW, SEED_MAX, SamplingParams
from leyline_agent.server.errors import RequestError
from leyline_agent.server.openai_api import (
    ChatCompletionRequest,
    CompletionRequest,
)

__all__ = [
    "GREEDY_BELOW",
    "SEED_MAX",
    "ModelLimits",
    "ServedModel",
    "check_message_shapes",
    "check_messages",
    "check_prompt_ids",
    "check_prompt_length",
    "completion_prompt",
    "messages_for_template",
    "sampling_params",
]

MAX_STOP = 16
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # as OpenAI's legacy completions API
# Chat without max_tokens: OpenAI runs to the context's end. One worker serves every
# session, so an unbounded answer (a random-weight model rarely stops) would stall them
# all; the default is capped (``create_app(default_max_tokens=...)``).
CHAT_DEFAULT_MAX_TOKENS = 1024


@dataclass(frozen=True, slots=True)
class ModelLimits:
    vocab_size: int
    max_context: int | None
    longest_token_bytes: int | None = None  # None: no lower bound from text length


@dataclass(frozen=True, slots=True)
class ServedModel:
    """The one model this server serves, and the names a request may call it by."""

    id: str
    aliases: frozenset[str]
    created: int
    limits: ModelLimits
    default_max_tokens: int = CHAT_DEFAULT_MAX_TOKENS
    max_prompt_tokens: int | None = None  # None: the model's context
    max_tokens_cap: int | None = None  # the largest max_tokens a request may ask for

    def check(self, requested: str | None) -> None:
        validate.check_served(requested, self.id, self.aliases)

    @property
    def request_limits(self) -> validate.RequestLimits:
        """The bounds every request is checked against (``directives.validate``)."""
        return validate.RequestLimits(
            self.limits.vocab_size, self.max_prompt_tokens, self.limits.longest_token_bytes
        )


def _refuse_unsupported(req: ChatCompletionRequest | CompletionRequest) -> None:
    if req.n not in (None, 1):
        raise RequestError("only n=1 is supported", "n")
    for name in ("frequency_penalty", "presence_penalty"):
        if getattr(req, name) not in (None, 0, 0.0):
            raise RequestError("penalties are not supported; leave it unset or 0", name)
    if req.logit_bias:
        raise RequestError("logit_bias is not supported", "logit_bias")
    if isinstance(req, CompletionRequest):
        if req.echo:
            raise RequestError("echo is not supported", "echo")
        if req.best_of not in (None, 1):
            raise RequestError("only best_of=1 is supported", "best_of")
        if req.suffix:
            raise RequestError("suffix is not supported", "suffix")


def _stop(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    items = [stop] if isinstance(stop, str) else list(stop)
    if len(items) > MAX_STOP:
        raise RequestError(f"at most {MAX_STOP} stop strings", "stop")
    for k, s in enumerate(items):
        if not s:
            raise RequestError(
                "a stop string must not be empty",
                f"stop[{k}]" if isinstance(stop, list) else "stop",
            )
    return items


def sampling_params(
    req: ChatCompletionRequest | CompletionRequest,
    prompt_len: int,
    model: ServedModel,
    grammar: GrammarSpec | None = None,
) -> SamplingParams:
    """The engine's ``SamplingParams`` for ``req`` (raises ``RequestError`` naming the field);
    ``grammar`` is what the answer is constrained to (``response_format.answer_grammar``)."""
    _refuse_unsupported(req)
    limits = model.limits
    field, max_tokens = "max_tokens", req.max_tokens
    if isinstance(req, ChatCompletionRequest):
        if req.max_completion_tokens is not None:
            field, max_tokens = "max_completion_tokens", req.max_completion_tokens
        want_logprobs = bool(req.logprobs)
        top = req.top_logprobs or 0
        if top and not want_logprobs:
            raise RequestError("top_logprobs needs logprobs: true", "top_logprobs")
    else:
        want_logprobs = req.logprobs is not None
        top = req.logprobs or 0
    chat = isinstance(req, ChatCompletionRequest)
    check_prompt_length(prompt_len, model, "messages" if chat else "prompt")
    room = None if limits.max_context is None else limits.max_context - prompt_len
    if room is not None and room < 1:
        raise RequestError(
            f"the prompt has {prompt_len} tokens; the model's context is {limits.max_context}",
            "messages" if chat else "prompt",
        )
    cap = model.max_tokens_cap
    if max_tokens is None:
        max_tokens = model.default_max_tokens if chat else COMPLETIONS_DEFAULT_MAX_TOKENS
        max_tokens = max_tokens if room is None else min(max_tokens, room)
        max_tokens = max_tokens if cap is None else min(max_tokens, cap)
    elif cap is not None and max_tokens > cap:
        raise RequestError(f"{max_tokens} is over this server's cap of {cap} tokens", field)
    elif room is not None and max_tokens > room:
        raise RequestError(
            f"{max_tokens} tokens after a {prompt_len}-token prompt exceed the model's "
            f"context of {limits.max_context}",
            field,
        )
    if req.seed is not None and not 0 <= req.seed <= SEED_MAX:
        raise RequestError(f"{req.seed} is outside [0, 2**63 - 1]", "seed")
    temperature = 1.0 if req.temperature is None else req.temperature  # OpenAI's default
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0 if temperature < GREEDY_BELOW else temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        seed=req.seed,
        stop=_stop(req.stop),
        logprobs=want_logprobs,
        top_logprobs=top,
        grammar=grammar,
        top_k=max(req.top_k or 0, 0),
        min_p=req.min_p or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        min_tokens=_min_tokens(req.min_tokens, max_tokens),
        ignore_eos=bool(req.ignore_eos),
    )


def _min_tokens(min_tokens: int | None, max_tokens: int) -> int:
    if min_tokens is not None and min_tokens > max_tokens:
        raise RequestError(f"{min_tokens} is more than max_tokens ({max_tokens})", "min_tokens")
    return min_tokens or 0


def check_messages(req: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """Validate each message's shape and the tools; return the tools to render (or None).

    ``tool_choice`` is checked by ``tool_choice.parse_tool_choice``."""
    check_message_shapes(req.messages, "messages")
    for i, raw in enumerate(req.messages):
        if raw["role"] == "tool" and not isinstance(raw.get("content"), str | list):
            raise RequestError("a tool message needs content", f"messages[{i}].content")
    if not req.tools:
        return None  # rendered even with tool_choice "none": the prompt is the same either way
    return canonical_tools([t.model_dump(exclude_none=True) for t in req.tools])


def messages_for_template(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What the chat template renders (``leyline_agent.chat_input``): text parts joined,
    ``developer`` as ``system``, keys the template does not need dropped. Both the chat route
    and message-form directives go through this and ``canonical_tools``, so they render a
    conversation identically."""
    return canonical_messages(messages)


def check_prompt_length(n_tokens: int, model: ServedModel, field: str) -> None:
    """Refuse a prompt of more than the server's ``max_prompt_tokens`` (exact count)."""
    validate.check_prompt_length(n_tokens, model.max_prompt_tokens, field)


def check_prompt_ids(ids: list[int], limits: ModelLimits, field: str) -> None:
    """Token ids inside the vocabulary (``directives.checks``, as the engine checks them)."""
    validate.check_prompt_ids(ids, limits.vocab_size, field)


def completion_prompt(req: CompletionRequest) -> str | list[int]:
    """One prompt: a string, or token ids used as given. Batches of prompts are refused."""
    p = req.prompt
    if not p:
        raise RequestError("the prompt is empty", "prompt")
    if isinstance(p, str):
        return p
    if p and all(isinstance(x, int) for x in p):
        return list(p)  # type: ignore[arg-type]
    if len(p) == 1:
        return p[0] if isinstance(p[0], str) else list(p[0])  # type: ignore[arg-type]
    raise RequestError("one prompt per request (batches are not supported)", "prompt")
