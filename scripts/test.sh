#!/usr/bin/env bash
# `make test` (what CI runs): the whole suite in three steps; each step runs its jobs in order,
# at most two at once (the machine has two cores), the next one starting as soon as one ends.
#  1. Set-up: scripts/setup.sh (.venv, the Codex CLI, SmolLM2) beside scripts/setup_vllm.sh
#     (.venv-vllm); the two share only the editable build of this tree, which each takes
#     under a lock. On a disk with too little room for both at once, one after the other.
#  2. The tests, in two lanes. First the main suite with .venv's pytest, without its tests
#     marked `timing`, beside tests/vllm with .venv-vllm's pytest (vLLM pins another torch than
#     .venv). Then tests/conformance (.venv-vllm's pytest) as four sessions, each taking the
#     first free lane: one per vLLM configuration (block 32, block 128, TP = 2: three `-k`
#     selections that together are the folder; one that selects nothing fails), and the
#     modules that start servers of their own (OWN). tests/vllm ends long before the main suite
#     (about 5 against 15 minutes), so the conformance sessions fill its lane, then the main
#     suite's, and the two lanes end close together; tests/vllm's session-wide servers (about
#     3 GB each) are gone by the time conformance starts its own, and each session holds one
#     vLLM server at a time, so two lanes hold at most two. Each configuration's server still
#     starts once, as in a single session. Much of every job waits on server start-ups and
#     model loads, so two side by side take little more than the longer alone.
#  3. The main suite's tests marked `timing` (a bound on latency: a bystander's worst token
#     gap, a refusal within 0.5 s), with nothing else of the suite running. tests/vllm and
#     tests/conformance have no such step: a latency bound there allows for another job
#     running beside it.
# Each job writes a log, printed whole when the job ends (scripts/jobs.sh's run_jobs).
# Every step runs even when an earlier test step failed; the exit status is non-zero when any
# job failed, and the last line names the failed jobs.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
source scripts/jobs.sh
LABEL="make test"
LOGS="$(mktemp -d "${TMPDIR:-/tmp}/leyline-test-XXXXXX")"
PYTEST=(-q -p no:cacheprovider)
MAIN=(.venv/bin/pytest "${PYTEST[@]}" tests --ignore=tests/vllm --ignore=tests/conformance)
VLLM=(.venv-vllm/bin/pytest "${PYTEST[@]}")
FAILED=()

# Disk: a fresh .venv takes about 7 GB and .venv-vllm about 6.3 GB, each with its downloads beside
# it while pip works (about 8 GB at its peak), and the tests write about 4 GB (generated models,
# the Responses store, logs). With less free than that, the set-ups run one after the other
# (a lower peak), and a failure prints what was free.
free_gb() { df -P -k "$ROOT" | awk 'NR == 2 { printf "%d", $4 / 1048576 }'; }
NEED_GB=4
[ -f .venv/.leyline-setup ] || NEED_GB=$((NEED_GB + 8))
[ -f .venv-vllm/.leyline-setup ] || NEED_GB=$((NEED_GB + 8))
SLOTS=2
if [ "$(free_gb)" -lt "$NEED_GB" ]; then
    echo "make test: $(free_gb) GB free under $ROOT, the set-ups and tests need about $NEED_GB GB: the set-ups run one after the other" >&2
    SLOTS=1
fi
run_jobs "$SLOTS" setup "bash scripts/setup.sh" setup-vllm "bash scripts/setup_vllm.sh"
if [ ${#FAILED[@]} -gt 0 ]; then
    echo "make test: the set-up failed (${FAILED[*]}): no tests ran; $(free_gb) GB free under $ROOT now" >&2
    exit 1
fi
OWN=(tests/conformance/test_pin.py tests/conformance/test_smollm2.py)
CONF="${VLLM[*]} tests/conformance$(printf ' --ignore=%s' "${OWN[@]}")"
run_jobs 2 main "${MAIN[*]} -m 'not timing'" \
    vllm "${VLLM[*]} tests/vllm" \
    conformance-block32 "$CONF -k 'not block128 and not tp2'" \
    conformance-block128 "$CONF -k block128" \
    conformance-tp2 "$CONF -k 'tp2 and not block128'" \
    conformance-own "${VLLM[*]} ${OWN[*]}"
run_jobs 1 main-timing "${MAIN[*]} -m timing"
rm -rf "$LOGS"
if [ ${#FAILED[@]} -gt 0 ]; then
    echo "make test: FAILED: ${FAILED[*]}" >&2
    exit 1
fi
echo "make test: passed (main, vllm, conformance-block32, conformance-block128, conformance-tp2, conformance-own, main-timing)"
