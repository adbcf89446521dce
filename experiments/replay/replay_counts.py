"""What a side-by-side configuration asks of the servers, counted without one.

For each session of ``leyline bench side-by-side`` (same trajectories, same policies, same
turns), every turn's prompt is rendered with the model's own chat template and compared
with the session's previous prompt. With a prefix cache that never evicts:

- ``radix`` prefills, per turn, the prompt after its longest common prefix with the last
  one (a session's first prompt: with any earlier session's first prompt, which shares the
  system prompt and tools): every policy edit costs a re-prefill from the edit point;
- ``new`` prefills only the tokens the unedited history adds per turn. A splice arm also
  prefills each replacement, so ``new`` is the floor of what it can prefill: no engine can
  beat ``new / radix`` in prefilled tokens on this configuration.

``leyline bench side-by-side --count`` prints these counts (and the turns and tokens a run
of one arm replays) so the cost of a configuration and the best ratio it allows are known
before hours of measurement.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .replay import personalize
from .trajectories import TrajectoryRecord

__all__ = ["common_prefix", "count"]


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def count(
    model_dir: Path, trajs: list[TrajectoryRecord], sessions: int, max_turns: int | None,
    policies_factory: Any,
) -> dict[str, int]:  # fmt: skip
    """Token counts of one run of ``sessions`` sessions (see the module docstring)."""
    from transformers import AutoTokenizer

    from leyline_agent.agent.session import ContextSession
    from leyline_agent.directives import Mode

    tok = AutoTokenizer.from_pretrained(str(model_dir))

    def ids(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[int]:
        text = tok.apply_chat_template(
            messages, tools=tools or None, add_generation_prompt=True, tokenize=False
        )
        return list(tok(text, add_special_tokens=False)["input_ids"])

    out = {"requests": 0, "prompt_tokens": 0, "longest_prompt": 0, "radix": 0, "new": 0}
    firsts: list[list[int]] = []  # every session's first prompt (edited and plain agree)
    for sid in range(sessions):
        traj = personalize(trajs[sid % len(trajs)], sid)
        session = ContextSession(policies_factory(), None, mode=Mode.AMORTIZE, session_id=str(sid))
        last_edited: list[int] = []
        last_plain: list[int] = []
        for turn, a in enumerate(traj.request_points(max_turns)):
            history = traj.messages[:a]
            edited = ids(session.plan(history, traj.tools).messages_to_send, traj.tools)
            plain = ids(history, traj.tools)
            if turn == 0:  # what an earlier session's first prompt shares with this one
                last_edited = max(firsts, key=lambda f: common_prefix(edited, f), default=[])
                last_plain = max(firsts, key=lambda f: common_prefix(plain, f), default=[])
                firsts.append(edited)
            out["radix"] += len(edited) - common_prefix(edited, last_edited)
            out["new"] += len(plain) - common_prefix(plain, last_plain)
            out["requests"] += 1
            out["prompt_tokens"] += len(edited)
            out["longest_prompt"] = max(out["longest_prompt"], len(edited))
            last_edited, last_plain = edited, plain
            session.observe_reply({"role": "assistant", "content": ""})
    return out


def report(counts: dict[str, int]) -> str:
    c = counts
    return (
        f"{c['requests']} requests, {c['prompt_tokens']} prompt tokens (longest "
        f"{c['longest_prompt']}); prefill with a prefix cache that never evicts: radix "
        f"{c['radix']}, the unedited history's new tokens {c['new']} (the floor of a splice "
        f"arm: {c['new'] / max(1, c['radix']):.2f}x radix)"
    )
