"""Pure: a ``DirectivesRequest``'s inputs as token ids (no torch, no vLLM).

Token form as is (text replacements encoded, ids checked against the vocabulary). Message
form: both lists rendered with the model's chat template (``add_generation_prompt=False``)
and tokenized, then diffed per message by ``leyline_agent.directives.compile`` (the same
diff as ``leyline serve`` and the SGLang plugin).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from leyline_agent.directives import Directive
from leyline_agent.errors import DirectiveError, TrajectoryError

__all__ = ["render", "token_form"]


def render(tokenizer: Any, messages: list[dict[str, Any]], tools: Any, where: str) -> list[int]:
    try:
        text = tokenizer.apply_chat_template(
            messages, tools=tools or None, tokenize=False, add_generation_prompt=False
        )
    except Exception as e:  # jinja raises many types
        raise TrajectoryError(f"{where}: the chat template cannot render them: {e}") from e
    return list(tokenizer.encode(text, add_special_tokens=False))


def token_form(
    tokens: Sequence[int], directives: Sequence[Directive], tokenizer: Any, vocab_size: int
) -> tuple[list[int], list[Directive]]:
    """``tokens`` and ``directives`` with text replacements encoded; ids checked against
    the vocabulary, naming the field."""
    for i, t in enumerate(tokens):
        if not 0 <= t < vocab_size:
            raise DirectiveError(
                f"tokens[{i}]: {t} is not a token id of this model (vocab {vocab_size})"
            )
    out = []
    for i, d in enumerate(directives):
        if isinstance(d.replacement, str):
            ids = list(tokenizer.encode(d.replacement, add_special_tokens=False))
            d = Directive(start=d.start, end=d.end, replacement=ids, mode=d.mode)
        for k, t in enumerate(d.replacement):
            if not 0 <= t < vocab_size:
                raise DirectiveError(
                    f"directives[{i}].replacement[{k}]: {t} is not a token id of this model"
                )
        out.append(d)
    return list(tokens), out
