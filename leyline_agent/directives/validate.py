"""A directive request checked once, the same way on every Leyline front.

``leyline serve`` and the vLLM plugin's ``/leyline/v1/directives`` both run a parsed JSON
body through ``parse_directives`` and ``checked``, so a bad request gets the same 4xx
naming the same field on both, before the cache or the engine is asked anything:

- the body's shape (``DirectivesRequest``: pydantic's own errors);
- the model name (``check_served``: 404 ``ModelNotFoundError``);
- token form: ``tokens`` and every replacement id inside the vocabulary, ``tokens`` and the
  spliced sequence within ``max_prompt_tokens``, each replacement too (a text replacement is
  bounded from below by its bytes before it is tokenized: ``check_text_bound``);
- message form: every message shaped as OpenAI's (``chat_shapes.ChatMessage``), the text of
  each list bounded the same way, every tool shaped (``ToolSpec``); the answer carries the
  messages and tools in the one canonical form every route renders (``chat_input``).

A refusal is a ``RequestError`` (400) whose message starts with the field's path.
What needs the cache (is the span cached?) is the backend's to say.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from leyline_agent.chat_input import canonical_messages, canonical_tools
from leyline_agent.chat_shapes import ChatMessage, ToolSpec
from leyline_agent.directives.checks import check_token_ids
from leyline_agent.directives.core import Directive
from leyline_agent.errors import ModelNotFoundError, RequestError
from leyline_agent.http_errors import field_path
from leyline_agent.wire import DirectivesRequest

__all__ = [
    "RequestLimits",
    "check_directive_sizes",
    "check_message_shapes",
    "check_prompt_ids",
    "check_prompt_length",
    "check_served",
    "check_text_bound",
    "checked",
    "longest_token_bytes",
    "message_text_bytes",
    "parse_directives",
]


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """What a front knows of its model before any request: the vocabulary, the longest
    prompt it takes (None: no bound), the bytes of its longest token (None: no bound of a
    text's tokens from its bytes)."""

    vocab_size: int
    max_prompt_tokens: int | None = None
    longest_token_bytes: int | None = None


def parse_directives(body: object) -> DirectivesRequest:
    """The parsed JSON ``body`` as a request (pydantic's ``ValidationError`` if it is not
    one; ``None`` is an empty body)."""
    return DirectivesRequest.model_validate(body)


def check_served(requested: str | None, served: str, aliases: Iterable[str] = ()) -> None:
    """``ModelNotFoundError`` unless ``requested`` is unset, ``served`` or an alias."""
    if requested is not None and requested != served and requested not in set(aliases):
        raise ModelNotFoundError(
            f"the model {requested!r} does not exist; this server serves {served!r}", "model"
        )


def check_prompt_length(n_tokens: int, limit: int | None, field: str) -> None:
    """Refuse a prompt of more than ``limit`` tokens (exact count)."""
    if limit is not None and n_tokens > limit:
        raise RequestError(f"the prompt has {n_tokens} tokens; the limit is {limit}", field)


def check_prompt_ids(ids: Sequence[int], vocab_size: int, field: str) -> None:
    """Token ids inside the vocabulary (``directives.checks``, as the engines check them)."""
    check_token_ids(ids, vocab_size, field, error=RequestError)


def message_text_bytes(messages: Iterable[Any]) -> int:
    """UTF-8 bytes of the text of ``messages`` that the chat template copies verbatim."""
    total = 0
    for m in messages:
        if not isinstance(m, dict):
            continue
        content = m.get("content")
        if isinstance(content, str):
            total += len(content.encode("utf-8", "surrogatepass"))
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    total += len(part["text"].encode("utf-8", "surrogatepass"))
    return total


def check_text_bound(
    utf8_bytes: int, longest: int | None, max_tokens: int | None, field: str
) -> None:
    """Refuse a text whose token count is surely above ``max_tokens`` (before tokenizing)."""
    if longest is None or max_tokens is None:
        return
    at_least = utf8_bytes // longest
    if at_least > max_tokens:
        raise RequestError(
            f"the prompt has at least {at_least} tokens ({utf8_bytes} bytes of text); "
            f"the limit is {max_tokens}",
            field,
        )


def longest_token_bytes(tokenizer: Any) -> int | None:
    """Bytes of the longest token, or None where a byte count does not bound the tokens:
    each token of a byte-level tokenizer without a normalizer covers at most that many
    bytes, so ``utf8_bytes // longest`` is a lower bound on a text's token count.

    ``decode`` of one token is never shorter than the token's bytes (a partial UTF-8
    sequence decodes to U+FFFD, 3 bytes, for at most 3 bytes), so the maximum is safe.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.normalizer is not None:
        return None
    if "ByteLevel" not in repr(backend.pre_tokenizer):
        return None
    longest = 0
    for i in range(len(tokenizer)):
        text = tokenizer.decode([i], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        longest = max(longest, len(text.encode("utf-8", "surrogatepass")))
    return longest or None


def check_message_shapes(messages: Sequence[Any], name: str) -> None:
    """Every message of ``messages`` shaped as OpenAI's (``RequestError`` naming
    ``name[i].field``); the chat routes and message-form directives all check with it."""
    for i, raw in enumerate(messages):
        try:
            ChatMessage.model_validate(raw)
        except ValidationError as e:
            err = e.errors()[0]
            raise RequestError(
                err.get("msg", "invalid message"), field_path((name, i, *err["loc"]))
            ) from e


def check_directive_sizes(
    tokens: Sequence[int], directives: Sequence[Directive], limits: RequestLimits
) -> None:
    """Refuse, before any prefill, a replacement or a resulting sequence longer than
    ``max_prompt_tokens``: such a splice would hold the engine for its R prefill and leave
    rows no completion may use. A text replacement is counted from below (its bytes over
    the longest token's) before it is tokenized, so a huge text is refused untokenized."""
    limit = limits.max_prompt_tokens
    if limit is None:
        return
    longest = limits.longest_token_bytes
    length, from_below = len(tokens), False
    for i, d in enumerate(directives):
        field = f"directives[{i}].replacement"
        if isinstance(d.replacement, str):
            n_bytes = len(d.replacement.encode("utf-8", "surrogatepass"))
            check_text_bound(n_bytes, longest, limit, field)
            n, from_below = (n_bytes // longest if longest else 0), True
        else:
            n = len(d.replacement)
            if n > limit:
                raise RequestError(f"the replacement has {n} tokens; the limit is {limit}", field)
        length += n - (d.end - d.start)
    if length > limit:
        raise RequestError(
            f"the spliced sequence would have {'at least ' * from_below}{length} tokens; "
            f"the limit is {limit}",
            "directives",
        )


def checked(req: DirectivesRequest, limits: RequestLimits) -> DirectivesRequest:
    """``req`` checked against ``limits`` (the module doc); message form comes back with
    its messages and tools in the canonical form the chat routes render."""
    if req.tokens is not None and req.directives is not None:
        check_prompt_length(len(req.tokens), limits.max_prompt_tokens, "tokens")
        check_prompt_ids(req.tokens, limits.vocab_size, "tokens")
        check_directive_sizes(req.tokens, req.directives, limits)
        for i, d in enumerate(req.directives):
            if isinstance(d.replacement, list) and d.replacement:
                check_prompt_ids(d.replacement, limits.vocab_size, f"directives[{i}].replacement")
        return req
    assert req.old_messages is not None and req.new_messages is not None  # the model's invariant
    check_message_shapes(req.old_messages, "old_messages")
    check_message_shapes(req.new_messages, "new_messages")
    for name, messages in (("old_messages", req.old_messages), ("new_messages", req.new_messages)):
        check_text_bound(
            message_text_bytes(messages), limits.longest_token_bytes, limits.max_prompt_tokens, name
        )
    for i, tool in enumerate(req.tools or []):
        try:
            ToolSpec.model_validate(tool)
        except ValidationError as e:
            raise RequestError(e.errors()[0].get("msg", "invalid tool"), f"tools[{i}]") from e
    return req.model_copy(
        update={
            "old_messages": canonical_messages(req.old_messages),
            "new_messages": canonical_messages(req.new_messages),
            "tools": canonical_tools(req.tools),
        }
    )
