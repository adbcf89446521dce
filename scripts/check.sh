#!/usr/bin/env bash
# `make check`'s tests (the quick tier): the main suite with .venv's pytest, tests/vllm,
# tests/conformance and tests/reliability left out, with the arguments given (the Makefile's
# `-m "not slow" --unmarked-slow-s 20`), as two pytest sessions side by side (the machine has
# two cores; about a quarter of a session's CPU time is importing its test modules, and two
# sessions on two halves of the folders split that too). The first half is FIRST, named
# folders; the second is everything else, so a new folder or module is never left out. Each
# session's log is printed whole as it ends; the exit status is non-zero when either failed,
# and the last line names it.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
source scripts/jobs.sh
LOGS="$(mktemp -d "${TMPDIR:-/tmp}/leyline-check-XXXXXX")"
LABEL="make check"
FAILED=()
FIRST=(tests/engine tests/kernels tests/sglang tests/policies)
PYTEST=".venv/bin/pytest -q -p no:cacheprovider $(printf '%q ' "$@")"
REST="tests --ignore=tests/vllm --ignore=tests/conformance --ignore=tests/reliability"
REST+="$(printf ' --ignore=%q' "${FIRST[@]}")"
run_jobs 2 check-first "$PYTEST ${FIRST[*]}" check-rest "$PYTEST $REST"
rm -rf "$LOGS"
if [ ${#FAILED[@]} -gt 0 ]; then
    echo "make check: FAILED: ${FAILED[*]}" >&2
    exit 1
fi
echo "make check: passed (check-first, check-rest)"
