"""mini-swe-agent (``DefaultAgent`` + ``LitellmModel`` + ``LocalEnvironment``) against a real
``leyline serve`` on loopback, with no Leyline client wrapper at all.

The model is the tiny engine answering a script (``ScriptedEngine``: a random-weight model
cannot drive a tool loop): ``bash`` tool calls, as mini-swe-agent 2's default (``mini.yaml``,
tool calling) expects. The loop, the parsing of the tool calls, the real shell commands run
in a temporary folder, the observation messages and the ``COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT``
exit are mini-swe-agent's. Its history is append-only; the edit is made through its own
extension point (``DefaultAgent.query``, "override to add hooks"): SWE-agent's
``last_n_observations`` recipe, old tool results stubbed in place. The server splices those
edits itself (``--client-edits amortize``); under ``off`` it splices nothing and serves
the same prompts. Checks: splices in ``/leyline/v1/stats`` and the engine's prompts are the
tokenizer's template on exactly what mini-swe-agent sent (recorded by an httpx hook on
LiteLLM's ``client_session``: mini-swe-agent's config cannot hold a client).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import httpx
import pytest
import yaml

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # never fetch the cost map
os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")  # no banner
os.environ.setdefault("MSWEA_GLOBAL_CONFIG_DIR", tempfile.mkdtemp(prefix="mswea-"))  # not ~/.config
import litellm  # noqa: E402
import minisweagent  # noqa: E402, F401  -- the frameworks extra (scripts/setup.sh): fail, never skip
from minisweagent.agents.default import DefaultAgent  # noqa: E402
from minisweagent.config import builtin_config_dir  # noqa: E402
from minisweagent.environments.local import LocalEnvironment  # noqa: E402
from minisweagent.models.litellm_model import LitellmModel  # noqa: E402

from leyline_agent.testing.frameworks import Recorder, rendered, scripted_server, stats  # noqa: E402
from leyline_agent.testing.scripted_engine import tool_call  # noqa: E402

N_FILES = 4
KEEP = 2
SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
SCRIPT = [tool_call("bash", {"command": f"cat f{k}.py"}) for k in range(N_FILES)]
SCRIPT.append(tool_call("bash", {"command": SUBMIT}))


def stub(content: str) -> str:
    return f"Old environment output: ({len(content.splitlines())} lines omitted)"


class LastNObservationsAgent(DefaultAgent):
    """mini-swe-agent's agent with SWE-agent's ``last_n_observations``: before each query,
    the tool results of all but the newest ``KEEP`` steps are stubbed, in place and once."""

    def query(self) -> dict:
        results = [m for m in self.messages if m.get("role") == "tool"]
        for m in results[: max(0, len(results) - KEEP)]:
            if not m["extra"].get("elided"):
                m["content"], m["extra"]["elided"] = stub(m["content"]), True
        return super().query()


def file_text(k: int) -> str:
    return "".join(f"def f{k}_{j}():\n    return {j * 7}\n" for j in range(20))


@pytest.fixture
def recorder():
    """What LiteLLM sends, recorded on the httpx client it sends with (a global of LiteLLM)."""
    rec = Recorder()
    before, litellm.client_session = (
        litellm.client_session,
        httpx.Client(event_hooks={"request": [rec]}),
    )
    try:
        yield rec
    finally:
        litellm.client_session.close()
        litellm.client_session = before


@pytest.mark.parametrize("client_edits", ["amortize", "off"])
def test_last_n_observations_are_spliced_by_the_server(
    client_edits, recorder, tmp_path: Path, monkeypatch
):
    # a failed call fails the test at once (mini-swe-agent retries 10 times by default)
    monkeypatch.setenv("MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT", "1")
    for k in range(N_FILES):
        (tmp_path / f"f{k}.py").write_text(file_text(k))
    config = yaml.safe_load((builtin_config_dir / "mini.yaml").read_text())
    # ``mode`` belongs to the interactive agent
    agent_config = {k: v for k, v in config["agent"].items() if k != "mode"}
    with scripted_server(SCRIPT, client_edits=client_edits) as (srv, engine):
        model = LitellmModel(
            model_name=f"openai/{engine.model_name}",
            model_kwargs={"api_base": srv.base_url, "api_key": "none", "num_retries": 0},
            cost_tracking="ignore_errors",  # a local model has no price
            **{k: config["model"][k] for k in ("observation_template", "format_error_template")},
        )  # fmt: skip
        env = LocalEnvironment(cwd=str(tmp_path), **config["environment"])
        agent = LastNObservationsAgent(model, env, **agent_config)
        out = agent.run(f"read the {N_FILES} files")
        assert out["exit_status"] == "Submitted", out
        bodies = recorder.bodies
        assert len(bodies) == N_FILES + 1
        for k, body in enumerate(bodies):
            results = [m["content"] for m in body["messages"] if m["role"] == "tool"]
            assert len(results) == k
            # the real shell's output, the older ones stubbed by the agent's hook
            assert sum(r.startswith("Old environment output:") for r in results) == max(0, k - KEEP)
            assert all(f"return {19 * 7}" in r for r in results[max(0, k - KEEP) :])
        # served exactly what mini-swe-agent sent (its edits included)
        assert engine.prompts == [rendered(engine.tokenizer, b) for b in bodies]
        # each newly stubbed result spliced in place (amortize), none under off
        s = stats(srv)
        assert s["splices"]["amortize"] == (N_FILES - KEEP if client_edits == "amortize" else 0), s
