"""What a request may pass to the chat template, and whether the template reads it.

``template_reads(engine, name)``: the served model's chat template reads the variable
``name`` (jinja2's own parse: ``jinja2.meta.find_undeclared_variables``), so a request field
that becomes that variable (``reasoning_effort``, a ``chat_template_kwargs`` key) changes the
prompt. A template that does not read it would drop it silently: the routes refuse such a
key, or list a hint as ignored (``request_fields``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from leyline_agent.server.errors import RequestError
from leyline_agent.server.request_fields import Ignored, check_effort

__all__ = ["TemplateOptions", "template_options", "template_reads", "template_variables"]


@lru_cache(maxsize=8)
def template_variables(template: str) -> frozenset[str]:
    """The variables ``template`` reads from its context (not those it sets itself)."""
    import jinja2
    from jinja2 import meta

    return frozenset(meta.find_undeclared_variables(jinja2.Environment().parse(template)))


def template_reads(engine: Any, name: str) -> bool:
    """Whether ``engine``'s chat template reads ``name`` (False without a template)."""
    template = getattr(engine.tokenizer, "chat_template", None)
    return isinstance(template, str) and name in template_variables(template)


# apply_chat_template's own arguments: a chat_template_kwargs key may not set them
_RESERVED = frozenset(
    {"messages", "conversation", "tools", "documents", "add_generation_prompt",
     "continue_final_message", "tokenize", "chat_template", "return_dict"}
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class TemplateOptions:
    """How a chat request's prompt is rendered: ``add_generation_prompt`` and the keyword
    arguments of ``apply_chat_template`` (``chat_template_kwargs``, ``reasoning_effort``,
    ``continue_final_message``). ``plain``: the server's default rendering."""

    add_generation_prompt: bool = True
    kwargs: Mapping[str, Any] = field(default_factory=dict)

    @property
    def plain(self) -> bool:
        return self.add_generation_prompt and not self.kwargs


def template_options(req: Any, engine: Any) -> tuple[TemplateOptions, list[Ignored]]:
    """The rendering ``req`` (a chat request) asks for, checked: a bad value, or a
    ``chat_template_kwargs`` key the template does not read, is a 400 naming it;
    ``reasoning_effort`` for a template that reads none is a hint (listed as ignored)."""
    notes: list[Ignored] = []
    kwargs: dict[str, Any] = {}
    effort = req.reasoning_effort
    if effort is not None:
        check_effort(effort, "reasoning_effort")
        if template_reads(engine, "reasoning_effort"):
            kwargs["reasoning_effort"] = effort
        else:
            notes.append(Ignored("reasoning_effort", "the chat template reads no effort"))
    for key, value in (req.chat_template_kwargs or {}).items():
        where = f"chat_template_kwargs.{key}"
        if key in _RESERVED:
            raise RequestError("an argument of the renderer, not a template variable", where)
        if not template_reads(engine, key):
            raise RequestError(f"the chat template reads no {key!r}", where)
        kwargs[key] = value
    if req.continue_final_message:
        if req.add_generation_prompt:
            raise RequestError(
                "continue_final_message needs add_generation_prompt: false",
                "continue_final_message",
            )
        if req.messages[-1].get("role") != "assistant":
            raise RequestError(
                "continue_final_message needs an assistant message last", "continue_final_message"
            )
        kwargs["continue_final_message"] = True
    return TemplateOptions(req.add_generation_prompt, kwargs), notes
