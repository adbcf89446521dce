"""``leyline eval mini-nightmare`` end to end: debug-gym's froggy on a LocalTerminal, its
LLM a scripted model served over real loopback HTTP.

The script that applies the known fix of ``purr`` must be recognised as solved (by
debug-gym's own pytest run), a script that only looks must not; finished episodes survive
reruns and errors; bad input is named.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import debug_gym  # noqa: E402, F401  -- set up by scripts/setup.sh; fail, never skip

from leyline_agent.errors import LeylineError, RuntimeUnavailableError  # noqa: E402
from leyline_agent.experiments.eval.dataset import installed_task_root  # noqa: E402
from leyline_agent.experiments.eval.eval_config import load_eval_config  # noqa: E402
from leyline_agent.experiments.eval.eval_run import run_eval  # noqa: E402
from leyline_agent.testing.purr import PURR_FIX  # noqa: E402
from leyline_agent.testing.scripted import ReplayModel  # noqa: E402
from leyline_agent.testing.stub_server import StubServer  # noqa: E402

pytestmark = pytest.mark.slow

VIEW = {"content": "Let me read the code.", "tool": "view", "arguments": {"path": "purr_code.py"}}
FIX_TURNS = [
    VIEW,
    {
        "content": "Swap the branches.",
        "tool": "edit",
        "arguments": {"path": "purr_code.py", "start": 27, "end": 32, "new_code": PURR_FIX},
    },
    {"content": "Run the tests.", "tool": "eval", "arguments": {}},
]


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from leyline_agent.engine.checkpoints.modelgen import make_model

    return make_model("llama", "tiny", tmp_path_factory.mktemp("tiny") / "model", seed=0)


def _eval(server: StubServer, out: Path, tok: Path, **kw):
    if "base_url" not in kw:
        kw["base_url"] = server.base_url
    args = dict(
        model=server.model,
        arms="baseline",
        tasks="purr",
        runs=1,
        out=out,
        config=load_eval_config(),
        max_steps=4,
        tokenizer=str(tok),
        progress=False,
    )
    args.update(kw)
    return run_eval(**args)


def _records(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "episodes.jsonl").read_text().splitlines()]


def test_known_fix_is_solved_and_rerun_skips_it(tmp_path: Path, tokenizer_dir: Path) -> None:
    assert "elif self.hunger > 20" in (installed_task_root() / "purr" / "purr_code.py").read_text()
    with StubServer(ReplayModel(FIX_TURNS), directive_answer="fallback") as server:
        summary = _eval(server, tmp_path, tokenizer_dir)
        sent = len(server.chat_bodies())
        [rec] = _records(tmp_path)
        assert rec["solved"] is True and rec["status"] == "done"
        assert rec["steps"] == 3 == sent  # view, edit, eval -> terminated on resolution
        assert rec["score"] == rec["max_score"] == 1
        assert rec["prompt_tokens"] == server.stats().prompt_tokens > 0
        assert summary["arms"]["baseline"]["solve_rate"] == 1.0
        for name in ("summary.json", "summary.md", "summary.png", "trajectories.jsonl"):
            assert (tmp_path / name).stat().st_size > 0
        traj = json.loads((tmp_path / "trajectories.jsonl").read_text().splitlines()[0])
        assert [m["role"] for m in traj["messages"]][-1] == "assistant"
        assert any(m["role"] == "tool" for m in traj["messages"])
        _eval(server, tmp_path, tokenizer_dir)  # rerun: nothing left to do
        assert len(server.chat_bodies()) == sent
        assert len(_records(tmp_path)) == 1


def test_looking_only_is_not_solved(tmp_path: Path, tokenizer_dir: Path) -> None:
    with StubServer(ReplayModel([VIEW]), directive_answer="fallback") as server:
        _eval(server, tmp_path, tokenizer_dir, max_steps=3)
        [rec] = _records(tmp_path)
        assert rec["solved"] is False and rec["status"] == "done"
        assert rec["steps"] == len(server.chat_bodies()) == 3  # --max-steps counts actions
        assert rec["score"] == 0


def test_stale_tool_arm_edits_what_the_server_receives(tmp_path: Path, tokenizer_dir: Path) -> None:
    # Replies without a tool call (as a weak model gives) in between: debug-gym answers
    # them as tool results too, and their call ids must not collide.
    text_only = {"content": "Hmm, thinking."}
    with StubServer(
        ReplayModel([VIEW, text_only, text_only]), directive_answer="fallback"
    ) as server:
        _eval(server, tmp_path, tokenizer_dir, arms="baseline,stale-tool", max_steps=4)
        assert len(server.chat_bodies()) == 8
        # Requests 0-3 are the baseline episode, 4-7 the stale-tool one; the 4th request of
        # each carries three view results. keep=2: only the stale-tool arm stubs the oldest.
        base_tools = [m for m in server.chat_bodies()[3]["messages"] if m["role"] == "tool"]
        arm_tools = [m for m in server.chat_bodies()[7]["messages"] if m["role"] == "tool"]
        assert len(base_tools) == len(arm_tools) == 3
        assert "class Cat" in base_tools[0]["content"]
        assert "class Cat" not in arm_tools[0]["content"]
        assert arm_tools[0]["content"] != base_tools[0]["content"]
        assert [m["content"] for m in arm_tools[1:]] == [m["content"] for m in base_tools[1:]]


def test_timeout_is_recorded_and_earlier_episodes_kept(tmp_path: Path, tokenizer_dir: Path) -> None:
    with StubServer(ReplayModel([VIEW]), directive_answer="fallback") as server:
        _eval(server, tmp_path, tokenizer_dir, max_steps=1)
        slow = load_eval_config(task_timeout_s=0.5)
        _eval(server, tmp_path, tokenizer_dir, max_steps=1, runs=2, config=slow)
    recs = _records(tmp_path)
    assert [(r["run"], r["status"]) for r in recs] == [(0, "done"), (1, "timeout")]
    assert recs[1]["solved"] is False


def test_bad_input_is_named(tmp_path: Path, tokenizer_dir: Path) -> None:
    with StubServer(ReplayModel([VIEW]), directive_answer="fallback") as server:
        with pytest.raises(LeylineError, match="--arms: unknown arm.*nope"):
            _eval(server, tmp_path, tokenizer_dir, arms="baseline,nope")
        with pytest.raises(LeylineError, match="--tasks: unknown task.*nosuch"):
            _eval(server, tmp_path, tokenizer_dir, tasks="purr,nosuch")
        with pytest.raises(LeylineError, match="--model: 'other' is not served"):
            _eval(server, tmp_path, tokenizer_dir, model="other")
        url = server.base_url
    with pytest.raises(RuntimeUnavailableError, match="not reachable"):
        _eval(server, tmp_path, tokenizer_dir, base_url=url)


def test_arm_order_does_not_change_hit_rates(tmp_path: Path) -> None:
    """Two orders of the same arms against one real ``leyline serve`` (tiny model, real
    prefix cache): every arm's hit rate and prefilled tokens are the same in both. Without
    the flush before each arm the second order would find everything the first cached."""
    from leyline_agent.engine.checkpoints.store import tiny_model_dir
    from leyline_agent.engine.engine import Engine
    from leyline_agent.testing.server import serve_in_thread

    model_dir = tiny_model_dir("llama")
    engine = Engine.from_pretrained(model_dir)
    config = load_eval_config(generate={"max_tokens": 4, "temperature": 0.0})
    summaries = {}
    with serve_in_thread(engine) as srv:
        for order in ("baseline,stale-tool", "stale-tool,baseline"):
            summaries[order] = run_eval(
                base_url=srv.base_url,
                model=engine.model_name,
                arms=order,
                tasks="purr",
                runs=1,
                out=tmp_path / order.replace(",", "_"),
                config=config,
                max_steps=4,
                tokenizer=str(model_dir),
                progress=False,
            )["arms"]
    engine.cache.check()
    first, second = summaries.values()
    for arm in ("baseline", "stale-tool"):
        a, b = first[arm], second[arm]
        assert a["prompt_tokens"] > 0 and 0.0 < a["hit_rate"] < 1.0, a
        assert (a["hit_rate"], a["prefilled_tokens"]) == (b["hit_rate"], b["prefilled_tokens"])


def test_pytest_durations_are_scrubbed_from_eval_output() -> None:
    from leyline_agent.experiments.eval.nightmare import scrub_durations

    out = "F\n==== 1 failed in 0.75s ====\n"
    assert scrub_durations(out) == "F\n==== 1 failed ====\n"
    assert (
        scrub_durations("== 2 failed, 3 passed in 61.2s (0:01:01) ==") == "== 2 failed, 3 passed =="
    )
    assert scrub_durations("tests ran in 0.5s") == "tests ran in 0.5s"  # not a summary line
