#!/usr/bin/env bash
# `make test` (what CI runs): the whole suite in three steps, each a pair of jobs side by side
# or one job alone.
#  1. Set-up: scripts/setup.sh (.venv, the Codex CLI, SmolLM2) beside scripts/setup_vllm.sh
#     (.venv-vllm); the two share only the editable build of this tree, which each takes
#     under a lock.
#  2. The two halves beside each other: the main suite with .venv's pytest, without its tests
#     marked `timing`, and tests/vllm then tests/conformance with .venv-vllm's pytest (vLLM
#     pins another torch than .venv). Much of either half waits on server start-ups and model
#     loads, so the pair takes little more than the longer half alone. tests/vllm and
#     tests/conformance are two pytest sessions, so that tests/vllm's session-wide servers
#     (about 3 GB each) are gone before conformance starts its own.
#  3. The main suite's tests marked `timing` (a bound on latency: a bystander's worst token
#     gap, a refusal within 0.5 s), with nothing else of the suite running. tests/vllm and
#     tests/conformance have no such step: a latency bound there allows for the main suite
#     running beside it.
# Each job writes a log, printed whole when the job ends (two jobs' lines never interleave).
# Every step runs even when an earlier test step failed; the exit status is non-zero when any
# job failed, and the last line names the failed jobs.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
LOGS="$(mktemp -d "${TMPDIR:-/tmp}/leyline-test-XXXXXX")"
PYTEST=(-q -p no:cacheprovider)
MAIN=(.venv/bin/pytest "${PYTEST[@]}" tests --ignore=tests/vllm --ignore=tests/conformance)
VLLM=(.venv-vllm/bin/pytest "${PYTEST[@]}")
FAILED=()

# run_jobs NAME COMMAND [NAME COMMAND ...]: runs the commands (bash command lines) at once, each
# into $LOGS/NAME.log; prints each log as its command ends; appends failed NAMEs to FAILED.
run_jobs() {
    local -A names=()
    local pid rc t0=$SECONDS
    while [ $# -gt 1 ]; do
        bash -c "$2" >"$LOGS/$1.log" 2>&1 &
        names[$!]=$1
        echo "make test: $1: $2"
        shift 2
    done
    while [ ${#names[@]} -gt 0 ]; do
        wait -n -p pid "${!names[@]}"
        rc=$?
        echo "===== make test: ${names[$pid]} ended with exit status $rc after $((SECONDS - t0)) s ====="
        cat "$LOGS/${names[$pid]}.log"
        [ "$rc" -eq 0 ] || FAILED+=("${names[$pid]}")
        unset "names[$pid]"
    done
}

run_jobs setup "bash scripts/setup.sh" setup-vllm "bash scripts/setup_vllm.sh"
if [ ${#FAILED[@]} -gt 0 ]; then
    echo "make test: the set-up failed (${FAILED[*]}): no tests ran" >&2
    exit 1
fi
run_jobs main "${MAIN[*]} -m 'not timing'" \
    vllm+conformance "${VLLM[*]} tests/vllm; a=\$?; ${VLLM[*]} tests/conformance || exit; exit \$a"
run_jobs main-timing "${MAIN[*]} -m timing"
rm -rf "$LOGS"
if [ ${#FAILED[@]} -gt 0 ]; then
    echo "make test: FAILED: ${FAILED[*]}" >&2
    exit 1
fi
echo "make test: passed (main, vllm+conformance, main-timing)"
