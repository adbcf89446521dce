"""``leyline policies apply|list`` as a user runs it (a subprocess), on the 10-turn fixture."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from leyline_agent.cli import main

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "data" / "trajectory_10turn.json"


SCRIPT = Path(sys.executable).parent / "leyline"  # the console script the install made


def leyline(*args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    # cwd outside the repository: its policies/ and kernels/ must not shadow anything
    cmd = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "leyline_agent.cli"]
    return subprocess.run(
        [*cmd, *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=FIXTURE.parent,
    )


def expected_stale(messages: list[dict], keep: int) -> dict[int, str]:
    """Independently: tool results answering calls of all but the last ``keep`` tool turns."""
    turns = [m for m in messages if m["role"] == "assistant" and m.get("tool_calls")]
    names = {
        tc["id"]: tc["function"]["name"]
        for m in turns[: len(turns) - keep]
        for tc in m["tool_calls"]
    }
    return {
        i: f"[stale output of {names[m['tool_call_id']]} elided]"
        for i, m in enumerate(messages)
        if m["role"] == "tool" and m["tool_call_id"] in names
    }


def test_apply_on_the_10_turn_trajectory_stubs_exactly_the_stale_results_and_is_idempotent():
    text = FIXTURE.read_text()
    messages = json.loads(text)
    assert sum(1 for m in messages if m["role"] == "assistant" and m.get("tool_calls")) == 10
    run = leyline("policies", "apply", "--policy", "stale-tool", "--keep", "2", stdin=text)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    expect = expected_stale(messages, keep=2)
    assert len(expect) == 9  # 8 stale tool turns, one of them with two parallel calls
    assert [e["index"] for e in out["edits"]] == sorted(expect)
    assert all(e["policy"] == "stale-tool" for e in out["edits"])
    assert len(out["messages"]) == len(messages)
    for i, (before, after) in enumerate(zip(messages, out["messages"], strict=True)):
        if i in expect:
            assert after == {**before, "content": expect[i]}
            assert list(after) == list(before)  # same keys, same order
        else:  # byte-identical
            assert json.dumps(after, ensure_ascii=False) == json.dumps(before, ensure_ascii=False)
    # idempotent: the command's own output goes back in unchanged
    again = leyline("policies", "apply", "--policy", "stale-tool", "--keep", "2", stdin=run.stdout)
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout) == {"messages": out["messages"], "edits": []}
    assert again.stdout.split('"edits"')[0] == run.stdout.split('"edits"')[0]


def inproc(monkeypatch, capsys, *args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    """The same entry point in this process (a subprocess per case is slow on 2 cores)."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    rc = main(list(args))
    captured = capsys.readouterr()
    return subprocess.CompletedProcess(list(args), rc, captured.out, captured.err)


def test_two_policies_and_a_config_file(monkeypatch, capsys):
    messages = json.loads(FIXTURE.read_text())
    run = inproc(
        monkeypatch,
        capsys,
        "policies",
        "apply",
        "--policy",
        "failed-call",
        "--policy",
        "stale-tool",
        stdin=FIXTURE.read_text(),
    )
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    failed = next(
        i
        for i, m in enumerate(messages)
        if m["role"] == "tool" and m["content"].startswith("Invalid")
    )
    caller = next(
        i
        for i, m in enumerate(messages)
        if any(tc["id"] == messages[failed]["tool_call_id"] for tc in m.get("tool_calls") or ())
    )
    by_index = {e["index"]: e for e in out["edits"]}
    assert set(by_index) == set(expected_stale(messages, 2)) | {caller}
    # a stub is final: failed-call stubbed it first, stale-tool leaves it as it is
    assert by_index[failed]["policy"] == "failed-call"
    assert out["messages"][failed]["content"].startswith("[failed call elided] ")
    assert out["messages"][caller]["tool_calls"][0]["function"]["arguments"] == "{}"

    cfg = inproc(
        monkeypatch,
        capsys,
        "policies",
        "apply",
        "--config",
        "configs/policies/paper.yaml",
        "--keep",
        "4",
        stdin=FIXTURE.read_text(),
    )
    assert cfg.returncode == 0, cfg.stderr
    assert [e["index"] for e in json.loads(cfg.stdout)["edits"]] == sorted(
        expected_stale(messages, 4)
    )

    setk = inproc(
        monkeypatch,
        capsys,
        "policies",
        "apply",
        "--policy",
        "stale-tool",
        "--set",
        "stale-tool.exclude_tools=[view, bash]",
        "--input",
        str(FIXTURE),
    )
    assert setk.returncode == 0, setk.stderr
    names = {
        json.loads(setk.stdout)["messages"][e["index"]]["content"]
        for e in json.loads(setk.stdout)["edits"]
    }
    assert names == {"[stale output of pytest elided]", "[stale output of edit elided]"}


@pytest.mark.parametrize(
    "args,stdin,needle",
    [
        (["--policy", "stale-tool"], "not json", "stdin: not JSON"),
        (["--policy", "stale-tool"], '{"msgs": []}', "object with 'messages'"),
        (["--policy", "stale-tool"], '[{"content": "x"}]', "messages[0].role: missing"),
        (
            ["--policy", "stale-tool"],
            '[{"role": "tool", "tool_call_id": "c", "content": "x"}]',
            "messages[0].tool_call_id",
        ),
        (["--policy", "stale_tool"], "[]", "unknown policy 'stale_tool'"),
        (["--policy", "stale", "--keep", "1"], "[]", "--policy[0]: unknown policy 'stale'"),
        (["--policy", "stale-tool", "--keep", "0"], "[]", "stale-tool.keep"),
        (
            ["--policy", "failed-call", "--keep", "2"],
            "[]",
            "--keep: only applies to the stale-tool",
        ),
        ([], "[]", "--policy: give at least one policy"),
        (["--policy", "stale-tool", "--set", "keep=3"], "[]", "--set[0]"),
        (["--config", "configs/policies/nope.yaml"], "[]", "cannot read policy config"),
        (["--policy", "stale-tool", "--input", "/nonexistent/x.json"], "", "--input: cannot read"),
    ],
)
def test_bad_input_exits_2_naming_the_problem(args, stdin, needle, monkeypatch, capsys):
    run = inproc(monkeypatch, capsys, "policies", "apply", *args, stdin=stdin)
    assert run.returncode == 2
    assert needle in run.stderr
    assert run.stdout == ""


def test_list():
    run = leyline("policies", "list")
    assert run.returncode == 0, run.stderr
    first_words = [
        line.split()[0] for line in run.stdout.splitlines() if line and not line.startswith(" ")
    ]
    assert first_words == ["stale-tool", "failed-call", "module:Class"]
    for knob in [
        "keep",
        "placeholder",
        "exclude_tools",
        "min_tokens",
        "trigger_tokens",
        "clear_inputs",
        "clear_at_least",
        "after",
        "patterns",
    ]:
        assert f"  {knob} = " in run.stdout
