"""The mechanism benchmark end to end on a tiny model: files, and invariants between arms
measured in the same run (never constants).

- nocache: nothing is cached, every prompt token is prefilled;
- radix (edits, prefix cache only) re-prefills from each edit point: it prefills more and
  hits less than splice, which reuses the cache across the edit;
- splice prefills, per request, no more than full (the unedited upper bound): after a splice
  only the turn's new tokens miss, as without edits;
- splice and forget see the same prompts and the same request-level prefill; forget pays the
  tail again inside its directives.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from leyline_agent.engine.checkpoints.store import tiny_model_dir
from leyline_agent.errors import LeylineError
from leyline_agent.experiments.bench.mechanism import BenchSettings, run_mechanism
from leyline_agent.experiments.replay.replay import ARMS

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def bench(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("mech")
    st = BenchSettings.make([1, 2], list(ARMS), quick=True, reps=1)
    st.sessions = 2  # quick settings otherwise: 4 turns, short contents, 1 token
    rows = run_mechanism(tiny_model_dir("deepseek_v2"), st, out, progress=False)
    return out, {(r["arm"], r["concurrency"]): r for r in rows}


def test_files_and_rows(bench) -> None:
    out, rows = bench
    assert set(rows) == {(a, c) for a in ARMS for c in (1, 2)}
    data = json.loads((out / "results.json").read_text())
    for row in data:
        for key in (
            "arm",
            "concurrency",
            "hit_rate",
            "prefilled_tokens",
            "ttft_p50_s",
            "e2e_p50_s",
        ):
            assert key in row
    assert (out / "results.png").stat().st_size > 0
    assert "| splice |" in (out / "results.md").read_text()
    runs = json.loads((out / "runs.json").read_text())
    assert len(runs) == len(rows)


@pytest.mark.parametrize("c", [1, 2])
def test_arm_invariants(bench, c: int) -> None:
    _, rows = bench
    full, radix, splice, forget, nocache = (rows[(a, c)] for a in ARMS)
    assert full["requests"] == radix["requests"] == splice["requests"] == nocache["requests"]
    assert nocache["hit_rate"] == 0.0 and nocache["prefilled_tokens"] == nocache["prompt_tokens"]
    # The policies edited something, and the spliced arms executed those edits.
    assert splice["prompt_tokens"] == radix["prompt_tokens"] < full["prompt_tokens"]
    assert splice["splices"]["amortize"] > 0 and forget["splices"]["forget"] > 0
    assert splice["fallbacks"] == 0 and splice["runtime_failures"] == 0
    # Splice keeps the cache across edits; a plain radix cache does not.
    assert splice["hit_rate"] > radix["hit_rate"]
    assert splice["prefilled_tokens"] < radix["prefilled_tokens"]
    request_prefill = {
        a: rows[(a, c)]["prompt_tokens"] - rows[(a, c)]["cached_tokens"] for a in ARMS
    }
    assert request_prefill["splice"] <= request_prefill["full"]
    assert request_prefill["forget"] == request_prefill["splice"]
    assert forget["prefilled_tokens"] > splice["prefilled_tokens"]


def test_bad_arm_is_named() -> None:
    with pytest.raises(LeylineError, match="--arms: unknown arm.*warp"):
        BenchSettings.make([1], ["splice", "warp"], quick=True, reps=None)
    with pytest.raises(LeylineError, match="--reps"):
        BenchSettings.make([1], ["splice"], quick=True, reps=0)


class _Logged:
    """An engine that logs which arm's request it served, in order."""

    def __init__(self, engine, arm: str, log: list[str]) -> None:
        self.engine, self.arm, self.log = engine, arm, log

    def generate(self, *a, **k):
        self.log.append(self.arm)
        return self.engine.generate(*a, **k)

    def __getattr__(self, name: str):
        return getattr(self.engine, name)


def test_interleaved_arms_take_turns_and_count_as_alone() -> None:
    """Arms replayed interleaved alternate job by job, and each counts exactly the cached and
    prefilled tokens it counts when replayed alone (deterministic given the arm)."""
    from leyline_agent.engine.engine import Engine
    from leyline_agent.engine.model.loader import load
    from leyline_agent.experiments.bench.mechanism import POLICIES, cap_messages
    from leyline_agent.experiments.replay.replay import replay, replay_interleaved
    from leyline_agent.experiments.replay.trajectories import DEFAULT_SET, load_trajectories
    from leyline_agent.policies import load_policies

    ld = load(tiny_model_dir("llama"), dtype="float32", device="cpu")
    trajs = [cap_messages(t, 400).model_copy(update={"tools": []})
             for t in load_trajectories(DEFAULT_SET)]  # fmt: skip
    kw = dict(concurrency=2, sessions=2, policies_factory=lambda: load_policies(POLICIES),
              max_turns=6, max_tokens=1)  # fmt: skip
    arms = ["radix", "splice"]

    def fresh() -> Engine:
        return Engine(ld.model, ld.tokenizer, model_name=ld.name)

    alone = {a: replay(fresh(), a, trajs, **kw) for a in arms}
    log: list[str] = []
    together = replay_interleaved([(_Logged(fresh(), a, log), a) for a in arms], trajs, **kw)
    for a, res in zip(arms, together, strict=True):
        got = [(s.session, s.turn, s.cached_tokens, s.prefilled_tokens) for s in res.samples]
        want = [(s.session, s.turn, s.cached_tokens, s.prefilled_tokens) for s in alone[a].samples]
        assert got == want, a
    assert len(log) == 2 * len(alone["radix"].samples)
    assert log == ["radix", "splice"] * (len(log) // 2)  # one job of each in turn
