"""``bench side-by-side --count``: the prefill a configuration asks for, without a server."""

from __future__ import annotations

from leyline_agent.experiments.replay.replay_counts import count
from leyline_agent.experiments.replay.trajectories import TrajectoryRecord
from leyline_agent.policies import MessageEdit, Policy, Trajectory

OUTPUT = " ".join(f"line {i} of a long tool output" for i in range(60))


class StubFirstOutput(Policy):
    """From the third turn on, the first tool output becomes a stub."""

    name = "stub-first"

    def edits(self, trajectory: Trajectory) -> list[MessageEdit]:
        if len(trajectory.messages) < 7:
            return []
        return [MessageEdit(index=3, content="[stub]", policy=self.name)]


def _trajectory() -> TrajectoryRecord:
    msgs: list[dict] = [
        {"role": "system", "content": "You fix bugs."},
        {"role": "user", "content": "Fix it."},
    ]
    for k in range(4):
        call = {"id": f"c{k}", "type": "function",
                "function": {"name": "bash", "arguments": '{"command": "make"}'}}  # fmt: skip
        msgs.append({"role": "assistant", "content": f"Step {k}.", "tool_calls": [call]})
        msgs.append({"role": "tool", "tool_call_id": f"c{k}", "content": f"{k}: {OUTPUT}"})
    msgs.append({"role": "assistant", "content": "Done."})
    return TrajectoryRecord(id="t", source="test", task="t", tools=[], messages=msgs)


def test_an_edit_costs_radix_the_rest_of_the_prompt_and_not_the_floor(model_dir, tok):
    traj = [_trajectory()]
    plain = count(model_dir, traj, 2, None, lambda: [])
    edited = count(model_dir, traj, 2, None, lambda: [StubFirstOutput()])
    assert plain["requests"] == edited["requests"] == 10
    assert plain["radix"] == plain["new"]  # no edit: radix prefills only what is new
    assert edited["new"] == plain["new"]  # the floor does not depend on the policies
    # the turn that first stubs output 0 re-prefills what the last one had cached after it
    # (output 1 and its turn's few tokens), once in each of the two sessions; later turns
    # find the stub cached
    output = len(tok(f"1: {OUTPUT}", add_special_tokens=False)["input_ids"])
    assert 2 * output < edited["radix"] - edited["new"] < 2 * (output + 100)
    assert edited["prompt_tokens"] < plain["prompt_tokens"]
