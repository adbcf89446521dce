"""Directives: the paper's ``D = (start, end, replacement, mode)`` and how edits become them.

- ``core``: ``Directive``, ``Mode``, ``MessageEdit``, ``plan_batch`` (validate a batch, right
  to left) and ``splice_tokens`` (the pure ``T' = T[:start] + R + T[end:]``). These are wire
  contracts: ``wire``, ``trajectory`` and the policies build on them.
- ``compile``: message edits -> token directives (render with the chat template, diff the
  token ids per message, clip to the cached prefix; text replacements -> token ids).
- ``checks``: what a request hands a serving side, checked once: the messages to render
  (roles, content) and token ids.
- ``pipeline``: a request compiled (either form), then decided from the cached length of its
  base: a miss, a fallback, a noop or a plan. Every backend answers through it.
- ``backend``: the Protocols of what a backend provides around the pipeline (lookup, hold,
  row writes, commit).

Torch-free. This package's own namespace re-exports ``core`` only.
"""

from leyline_agent.directives.core import (
    RESERVED_MODES,
    Directive,
    ImplementedMode,
    MessageEdit,
    Mode,
    check_mode,
    plan_batch,
    splice_tokens,
)

__all__ = [
    "RESERVED_MODES",
    "Directive",
    "ImplementedMode",
    "MessageEdit",
    "Mode",
    "check_mode",
    "plan_batch",
    "splice_tokens",
]
