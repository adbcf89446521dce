"""``FailedCallDetector``: stub tool calls that failed once the agent has moved past them.

A call failed when its result matches one of ``patterns`` (regular expressions in RE2's
syntax, searched with ``^``/``$`` per line: ``text_match.compile_pattern``, time linear in
the result; at most ``MAX_PATTERNS``): a Python traceback, an ``...Error:`` line, ``error:``/``fatal:``, a
non-zero exit code (also mini-swe-agent's ``<returncode>N</returncode>``), a shell's
"command not found", the OpenAI Agents SDK's "An error occurred while running the tool", or an output that opens with
error/failed/invalid/unknown (debug-gym's tools answer "Invalid ...", its agent
"Unknown tool ..."). A test run that reports failing tests is not a failed call.

The agent has moved past a failure when a later call (in a later assistant message)
succeeded, or when ``after`` assistant turns have followed the failed result. Then the
result's content becomes a one-line stub naming the tool and the first error line, and
(``stub_arguments``) the call's arguments become ``"{}"``. Because ``after >= 1`` and both
rules need a later assistant message, the newest failure is never removed while it is the
newest thing the agent saw. Messages are never removed (indices stay stable): the failed
call's assistant message stays, only the failed call's arguments are emptied.

``observation_prefix`` (default None: off): also treat user messages opening with it
(smolagents' ``"Observation:"``) as tool results (``policies/observations``); their stub keeps
the prefix, and there are no arguments to empty.

``placeholder`` is literal text with two holes, ``{tool}`` and ``{error}``: a result is this
policy's stub when it is the placeholder with the holes filled (``text_match.fills_template``).

Idempotent, also in a pipeline: an elided result (this policy's stub or another policy's,
``Policy.elided``) is neither a failure nor a success: it is never detected again, and a
stale stub of a call that failed is no evidence that the agent recovered.
"""

from __future__ import annotations

import copy
from typing import Any

from pydantic import Field, field_validator

from leyline_agent.directives import MessageEdit
from leyline_agent.text_match import compile_pattern, fills_template
from leyline_agent.trajectory import ToolCall, Trajectory

from .base import Policy, SpliceKnobs, validate_knobs
from .observations import result_content

__all__ = ["DEFAULT_PATTERNS", "MAX_PATTERNS", "FailedCallConfig", "FailedCallDetector"]

MAX_PATTERNS = 64
_HOLES = ("{tool}", "{error}")

DEFAULT_PATTERNS: tuple[str, ...] = (
    r"Traceback \(most recent call last\)",  # a Python traceback
    r"^\s*(?:[A-Za-z_][\w.]*)?(?:Error|Exception)\b:",  # a "ValueError: ..." line
    r"(?i)^\s*(?:error|fatal)\s*:",  # "error: ...", "fatal: ..." (compilers, git, shells)
    r"(?i)\A\s*(?:error|failed|failure|invalid|unknown)\b",  # an output opening with failure
    r"(?i)\b(?:exit(?:ed)? (?:code|status)|returned non-zero exit status)[:= ]*[1-9]\d*",
    r"(?i)\bcommand not found\b",
    r"(?i)\bis not a valid tool\b",
    # the OpenAI Agents SDK's default tool-error text ("An error occurred while running the
    # tool. Please try again. Error: ...")
    r"(?i)\A\s*An error occurred while running the tool\b",
    r"<returncode>\s*-?[1-9]\d*\s*</returncode>",  # mini-swe-agent's observation format
)
_TRACEBACK = "Traceback (most recent call last)"


class FailedCallConfig(SpliceKnobs):
    patterns: tuple[str, ...] = Field(default=DEFAULT_PATTERNS, max_length=MAX_PATTERNS)
    after: int = Field(default=1, ge=1)
    placeholder: str = Field(default="[failed call elided] {tool}: {error}", min_length=1)
    stub_arguments: bool = True
    exclude_tools: tuple[str, ...] = ()
    max_error_chars: int = Field(default=160, ge=8)
    observation_prefix: str | None = Field(default=None, min_length=1)

    @field_validator("patterns")
    @classmethod
    def _compiles(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if not v:
            raise ValueError("give at least one pattern")
        for k, p in enumerate(v):
            try:
                compile_pattern(p)
            except ValueError as e:
                raise ValueError(f"patterns[{k}] {p[:80]!r} {e}") from e
        return v


class FailedCallDetector(Policy):
    """Stub failed tool calls (call + output) once the agent has moved past them."""

    name = "failed-call"
    config_class = FailedCallConfig

    def __init__(self, **knobs: Any) -> None:
        self.config = validate_knobs(FailedCallConfig, self.name, knobs)
        self._patterns = [compile_pattern(p, multiline=True) for p in self.config.patterns]

    def is_failure(self, text: str) -> bool:
        return not self._is_stub(text) and any(p.search(text) for p in self._patterns)

    def _is_stub(self, text: str) -> bool:
        return fills_template(text, self.config.placeholder, _HOLES)

    def error_line(self, text: str) -> str:
        """The line that says what went wrong: a traceback's exception line, else the first
        line matching a pattern, else the first non-empty line."""
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        line = lines[0] if lines else ""
        if _TRACEBACK in text:
            tail = text.split(_TRACEBACK, 1)[1].splitlines()
            exc = [ln.strip() for ln in tail if ln.strip() and not ln[:1].isspace()]
            if exc:
                line = exc[-1]
        else:
            for ln in lines:
                if any(p.search(ln) for p in self._patterns):
                    line = ln
                    break
        limit = self.config.max_error_chars
        return line if len(line) <= limit else line[: limit - 3] + "..."

    def is_stub(self, text: str, tool: str) -> bool:
        return self._is_stub(text)

    def stub(self, tool: str, text: str) -> str:
        return self.config.placeholder.replace("{tool}", tool).replace(
            "{error}", self.error_line(text)
        )

    def edits(self, trajectory: Trajectory) -> list[MessageEdit]:
        cfg = self.config
        trajectory = self.view(trajectory)
        failed: list[ToolCall] = []
        succeeded_at: list[int] = []  # assistant indices of calls that succeeded
        elided = self.elided(trajectory)
        for index, call in sorted(trajectory.result_of.items()):
            if index in elided:
                continue  # a stub says nothing about how the call went
            if self.is_failure(trajectory.text(index)):
                if call.name not in cfg.exclude_tools:
                    failed.append(call)
            else:
                succeeded_at.append(call.message_index)
        assistants = trajectory.assistant_indices
        out: list[MessageEdit] = []
        stub_args: dict[int, list[ToolCall]] = {}
        for call in failed:
            assert call.result_index is not None
            later_turns = sum(1 for a in assistants if a > call.result_index)
            recovered = any(a > call.message_index for a in succeeded_at)
            if later_turns < cfg.after and not (recovered and later_turns >= 1):
                continue
            text = trajectory.text(call.result_index)
            out.append(
                MessageEdit(
                    index=call.result_index,
                    content=result_content(
                        trajectory, call.result_index, self.stub(call.name, text)
                    ),
                    policy=self.name,
                    **cfg.splice(),
                    reason=f"{call.name} ({call.id}) failed and the agent moved past it",
                )
            )
            if call.position >= 0:  # an observation's call has no arguments to empty
                stub_args.setdefault(call.message_index, []).append(call)
        if cfg.stub_arguments:
            for index, calls in stub_args.items():
                tool_calls = copy.deepcopy(trajectory.messages[index]["tool_calls"])
                for call in calls:
                    tool_calls[call.position]["function"]["arguments"] = "{}"
                out.append(
                    MessageEdit(
                        index=index,
                        tool_calls=tool_calls,
                        policy=self.name,
                        **cfg.splice(),
                        reason="arguments of failed calls elided",
                    )
                )
        return sorted(out, key=lambda e: e.index)
