"""What every route reads: the worker, the served model, the memory of directive request ids
(used on the worker threads), the splice mode of client-made edits, the conversations found
by content (``chat_context``), the bounds on message lists checked before a body is
validated (``inputs``) and the count of request fields accepted as hints (``request_fields``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from fastapi import Request

from leyline_agent.front.conversations import ConversationStore
from leyline_agent.server.completions import ServedModel
from leyline_agent.server.directive_memory import DirectiveMemory
from leyline_agent.server.inputs import InputLimits
from leyline_agent.server.observability import ServerMetrics
from leyline_agent.server.request_fields import IgnoredCounts
from leyline_agent.server.worker import Worker

__all__ = ["ServerState", "state"]


@dataclass(frozen=True, slots=True)
class ServerState:
    worker: Worker
    model: ServedModel
    directive_memory: DirectiveMemory = field(default_factory=DirectiveMemory)
    client_edits: str = "off"  # amortize | forget | off (``leyline serve --client-edits``)
    conversations: ConversationStore = field(default_factory=ConversationStore)
    inputs: InputLimits = field(default_factory=InputLimits)
    metrics: ServerMetrics = field(default_factory=ServerMetrics)  # observability
    ignored: IgnoredCounts = field(default_factory=IgnoredCounts)  # request_fields


def state(request: Request) -> ServerState:
    return request.app.state.leyline
